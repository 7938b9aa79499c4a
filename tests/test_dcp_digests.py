"""DCP's files are checksummed as ``dcp.save`` writes them, and those digests are the files' own."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.counted_writes import CountedWrites
from torch.distributed.tensor import Shard, distribute_tensor

from spot_callbacks import CheckpointStore
from spot_callbacks.persist import dcp_digests
from spot_callbacks.persist.dcp_digests import HashingStream, digesting_writer, written_digests
from spot_callbacks.persist.sharded import ShardedPersister
from spot_callbacks.store import transfer
from spot_callbacks.store.checksums import WRITE_PIECE_BYTES, digest_local_file
from spot_callbacks.store.retry import RetryPolicy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FAST_RETRY = RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.01)


def test_every_file_dcp_writes_gets_the_digest_of_its_bytes_on_disk(tmp_path):
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(7), "step": 3, "note": "x"}
    folder = tmp_path / "ckpt"
    for threads in (1, 2):  # one file per rank, and DCP's writer threads each writing their own
        writer = digesting_writer(folder / str(threads), thread_count=threads, sync_files=True)
        dcp.save(state, storage_writer=writer, no_dist=True)
        digests = written_digests(writer)
        on_disk = {
            p.relative_to(folder / str(threads)).as_posix()
            for p in (folder / str(threads)).rglob("*")
            if p.is_file()
        }
        assert set(digests) == on_disk and ".metadata" in digests and len(on_disk) == 1 + threads
        for name, digest in digests.items():
            assert digest == digest_local_file(folder / str(threads) / name)


def test_a_file_changed_past_the_stream_or_a_sought_stream_has_no_digest(tmp_path):
    writer = digesting_writer(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(64)}, storage_writer=writer, no_dist=True)
    with open(tmp_path / "ckpt" / "__0_0.distcp", "ab") as handle:
        handle.write(b"late")
    assert set(written_digests(writer)) == {".metadata"}  # the grown file is hashed at upload instead

    stream = HashingStream(io.BytesIO())
    stream.write(b"abc")
    stream.seek(0)
    stream.write(b"z")
    assert stream.digest() is None


def test_a_sharded_checkpoint_uploads_with_the_written_digests_and_verifies(one_rank, tmp_path, monkeypatch):
    hashed_at_upload = []
    real = transfer.digest_mapped
    monkeypatch.setattr(
        transfer, "digest_mapped", lambda path: hashed_at_upload.append(path.name) or real(path)
    )
    store = CheckpointStore((tmp_path / "store").as_uri(), retry=FAST_RETRY)
    persister = ShardedPersister(store, scratch_root=tmp_path / "scratch", keep_last=0)
    state = {"model": {"w": distribute_tensor(torch.full((64, 4), 2.0), one_rank, [Shard(0)])}, "step": 1}
    persister.submit_state(1, "steps", "test", state, meta={"epoch": 1})
    assert persister.wait(timeout=60) and persister.close(timeout=60)
    info = store.latest()
    assert info is not None and {".metadata", "__0_0.distcp", "meta.pt"} == set(info.files)
    assert hashed_at_upload == ["meta.pt"]  # DCP's files came with their digests
    assert store.verify(1, deep=True)  # and every recorded checksum is the stored bytes'


def test_dcp_files_reach_the_disk_in_writes_of_a_quarter_mib_at_most(tmp_path, monkeypatch):
    """The kernel sizes a page-cache folio after the write: a tensor's bytes in one write take
    blocks of fresh memory that a VM handing free memory back to its host faults in again."""
    counted: dict[str, CountedWrites] = {}

    def counting(raw):
        counted[raw.name] = CountedWrites(raw)
        return HashingStream(counted[raw.name])

    monkeypatch.setattr(dcp_digests, "HashingStream", counting)
    big = torch.arange(3 * 1024 * 1024 // 4 + 5, dtype=torch.float32)  # 3 MiB + 20 bytes
    writer = digesting_writer(tmp_path / "ckpt")
    dcp.save({"big": big, "step": 1}, storage_writer=writer, no_dist=True)
    digests = written_digests(writer)
    data = tmp_path / "ckpt" / "__0_0.distcp"
    writes = counted[str(data)].writes
    assert sum(writes) == data.stat().st_size > big.nbytes
    assert max(writes) <= WRITE_PIECE_BYTES < big.nbytes
    assert digests["__0_0.distcp"] == digest_local_file(data)  # the pieces hashed in order
    loaded = {"big": torch.zeros_like(big), "step": 0}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(loaded["big"], big)
