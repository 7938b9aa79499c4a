"""Staging a state into reused host buffers, serializing it, and loading it safely."""

from __future__ import annotations

import pickle
import random
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers.counted_writes import CountedWrites
from helpers.reliability_counts import DAMAGED, record

from spot_callbacks import UnsafeCheckpointError, load_state
from spot_callbacks.staging import StagingArea, write_state
from spot_callbacks.store.checksums import digest_local_file


def training_state(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b) and a.dtype == b.dtype
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_staged_state_is_a_frozen_copy_and_round_trips(tmp_path):
    model, optimizer = training_state()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 7,
             "name": "run", "loops": OrderedDict(epoch=1, batches=[1, 2, 3])}  # fmt: skip
    expected = {"model": OrderedDict((k, v.clone()) for k, v in model.state_dict().items()), "step": 7}
    area = StagingArea()
    staged = area.stage(state)
    optim_tensors = [t for s in optimizer.state_dict()["state"].values() for t in s.values()]
    assert staged.nbytes == sum(
        t.numel() * t.element_size() for t in [*model.state_dict().values(), *optim_tensors]
    )

    with torch.no_grad():  # training goes on after the snapshot returned
        for p in model.parameters():
            p.add_(1.0)
    state["loops"]["batches"].append(4)
    assert_same(staged.state["model"], expected["model"])
    assert staged.state["loops"]["batches"] == [1, 2, 3]

    digest = write_state(staged, tmp_path / "state.pt")
    staged.release()
    assert digest == digest_local_file(tmp_path / "state.pt")
    loaded = load_state(tmp_path / "state.pt")
    assert_same(loaded["model"], expected["model"])
    assert loaded["step"] == 7 and loaded["loops"] == OrderedDict(epoch=1, batches=[1, 2, 3])
    assert loaded["model"]._metadata == model.state_dict()._metadata
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded["optimizer"])  # a real optimizer accepts it


def test_buffers_are_reused_across_checkpoints():
    model, optimizer = training_state()
    area = StagingArea()
    first = area.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    buffers = {k: v for k, v in first.state["model"].items()}
    first.release()
    with torch.no_grad():
        model[0].weight.mul_(2)
    second = area.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    assert all(second.state["model"][k] is buffers[k] for k in buffers)
    assert torch.equal(second.state["model"]["0.weight"], model[0].weight)
    total = area.buffer_bytes
    second.release()
    third = area.stage({"model": model.state_dict(), "optim": optimizer.state_dict()})
    assert area.buffer_bytes == total  # no growth: one set of buffers
    third.release()


def test_the_plan_is_reused_until_a_shape_changes_and_the_resume_stays_exact(tmp_path):
    model, optimizer = training_state()
    area = StagingArea()

    def stage_and_check(name, state):
        staged = area.stage(state)
        buffers = dict(staged.state["model"])
        write_state(staged, tmp_path / name)
        staged.release()
        loaded = load_state(tmp_path / name)
        assert_same(loaded, state)  # what a resume loads is the state at the snapshot, bit for bit
        return buffers, loaded

    first, _ = stage_and_check("a.pt", {"model": model.state_dict(), "optim": optimizer.state_dict()})
    model[0].weight.data = torch.randn(16, 8)  # new storages of the same shapes, as a reload leaves them
    state = optimizer.state[model[0].weight]
    state["exp_avg"] = state["exp_avg"] + 1
    second, _ = stage_and_check("b.pt", {"model": model.state_dict(), "optim": optimizer.state_dict()})
    assert area.plan_builds == 1  # new tensors of the same shapes refill the planned buffers
    assert all(second[k] is first[k] for k in first)

    model[2] = torch.nn.Linear(16, 6)  # a shape changes: its buffers are reallocated
    third, loaded = stage_and_check("c.pt", {"model": model.state_dict()})
    assert area.plan_builds == 2
    assert loaded["model"]["2.weight"].shape == (6, 16) and third["0.bias"] is first["0.bias"]
    # The optimizer state left the staged state: its buffers went with the old plan.
    assert area.buffer_bytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_dcp_writes_a_staged_buffer_in_place_and_torch_save_stores_only_its_bytes(tmp_path):
    """Each staged buffer owns exactly its bytes: DCP's writer clones a tensor whose storage is larger
    (a second copy of the shard while it writes), and torch.save of a view stores its whole storage."""
    from torch.distributed.checkpoint.filesystem import _SerialCpuLoader

    flat = torch.randn(3 * 1024)
    view = flat[:1024].view(32, 32)  # a view into a larger storage, as a flat buffer's would be
    staged = StagingArea().stage({"w": view})
    buffer = staged.state["w"]
    assert torch.equal(buffer, view) and buffer.untyped_storage().nbytes() == view.nbytes
    loader = _SerialCpuLoader(lambda item: item)
    loader.add(buffer.nbytes, buffer)
    loader.add(view.nbytes, view)
    (written, _), (cloned, _) = loader.values()
    assert written.data_ptr() == buffer.data_ptr()  # written from the buffer itself
    assert cloned.data_ptr() != view.data_ptr()  # what DCP does to a view: a copy
    write_state(staged, tmp_path / "state.pt")
    staged.release()
    torch.save({"w": view}, tmp_path / "view.pt")
    # The view's file holds the whole 12 KB storage; the staged one only its 4 KB.
    assert (tmp_path / "view.pt").stat().st_size > flat.nbytes > (tmp_path / "state.pt").stat().st_size


def test_a_tie_that_appears_follows_the_plan_as_an_alias():
    weight, bias = torch.randn(4, 4), torch.randn(4)
    area = StagingArea()
    area.stage({"a": weight.clone(), "b": weight.clone(), "c": bias}).release()
    staged = area.stage({"a": weight, "b": weight, "c": bias})  # "b" is now "a"
    assert staged.state["a"] is staged.state["b"] and staged.nbytes == (16 + 4) * 4
    assert torch.equal(staged.state["b"], weight) and torch.equal(staged.state["c"], bias)
    staged.release()
    assert area.plan_builds == 1  # an alias needs no buffer
    untied = area.stage({"a": weight, "b": weight.clone() + 1, "c": bias})  # and apart again
    assert untied.state["a"] is not untied.state["b"] and torch.equal(untied.state["b"], weight + 1)
    untied.release()
    assert area.plan_builds == 2  # "b" had no buffer in the plan: found by its path again


def test_tied_weights_stay_tied_and_are_staged_once(tmp_path):
    embedding = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = embedding.weight
    state = {"emb.weight": embedding.weight.detach(), "head.weight": head.weight.detach()}
    area = StagingArea()
    staged = area.stage(state)
    assert staged.state["emb.weight"] is staged.state["head.weight"]
    assert staged.nbytes == 10 * 4 * 4
    write_state(staged, tmp_path / "tied.pt")
    staged.release()
    loaded = load_state(tmp_path / "tied.pt")
    assert (
        loaded["emb.weight"].untyped_storage().data_ptr()
        == loaded["head.weight"].untyped_storage().data_ptr()
    )


def test_a_new_snapshot_waits_until_the_previous_one_is_released():
    area = StagingArea()
    first = area.stage({"w": torch.ones(3)})
    with pytest.raises(TimeoutError, match="staging buffers are busy"):
        area.stage({"w": torch.ones(3)}, timeout=0.05)
    got_it = threading.Event()

    def stage_again():
        area.stage({"w": torch.zeros(3)}).release()
        got_it.set()

    worker = threading.Thread(target=stage_again)
    worker.start()
    assert not got_it.wait(timeout=0.1)
    first.release()
    worker.join(timeout=10)
    assert got_it.is_set()


def test_non_tensor_leaves_are_deep_copied():
    rng = np.random.RandomState(0)
    state = {"np": rng.get_state(), "arr": np.arange(3)}
    staged = StagingArea().stage(state)
    state["arr"][0] = 99
    assert staged.state["arr"].tolist() == [0, 1, 2]
    assert staged.state["np"][0] == "MT19937"
    python_rng = random.getstate()
    staged = StagingArea().stage({"python": python_rng, "ids": [1, 2]})
    assert staged.state["python"][1] is python_rng[1]  # a tuple of ints is immutable: kept, not walked
    assert staged.state["python"] == python_rng and staged.state["ids"] == [1, 2]


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    torch.save({"weights": torch.ones(2), "payload": _Exploit(str(marker))}, path)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="safe loading refuses") as info:
        load_state(path)
    assert isinstance(info.value, pickle.UnpicklingError)
    assert str(path) in str(info.value)
    assert not marker.exists()
    record(DAMAGED)


def test_truncated_state_file_gives_a_clear_error(tmp_path):
    staged = StagingArea().stage({"w": torch.ones(1000)})
    write_state(staged, tmp_path / "s.pt")
    data = (tmp_path / "s.pt").read_bytes()
    (tmp_path / "s.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(RuntimeError):
        load_state(tmp_path / "s.pt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned staging path)")
def test_cuda_state_is_staged_into_pinned_buffers_without_blocking():
    model = torch.nn.Linear(256, 256).cuda()
    area = StagingArea()
    staged = area.stage(model.state_dict())
    assert staged.state["weight"].is_pinned() and staged.state["weight"].device.type == "cpu"
    with torch.no_grad():
        model.weight.add_(1.0)  # queued after the copy on the training stream
    staged.wait_copied()
    assert torch.equal(staged.state["weight"], (model.weight - 1.0).cpu())
    staged.release()


def test_a_state_reaches_the_disk_in_writes_of_a_quarter_mib_at_most(tmp_path, monkeypatch):
    """The kernel sizes a page-cache folio after the write: a tensor's bytes in one write take
    blocks of fresh memory that a VM handing free memory back to its host faults in again."""
    from spot_callbacks import staging
    from spot_callbacks.store.checksums import WRITE_PIECE_BYTES, ChecksumWriter

    counted: list[CountedWrites] = []
    monkeypatch.setattr(
        staging,
        "ChecksumWriter",
        lambda raw: ChecksumWriter(counted.append(CountedWrites(raw)) or counted[-1]),
    )
    big = torch.arange(3 * 1024 * 1024 // 4 + 5, dtype=torch.float32)  # 3 MiB + 20 bytes, one storage
    staged = StagingArea().stage({"big": big, "small": torch.ones(3), "step": 1})
    digest = write_state(staged, tmp_path / "state.pt")
    staged.release()
    writes = counted[0].writes
    assert sum(writes) == (tmp_path / "state.pt").stat().st_size > big.nbytes
    assert max(writes) <= WRITE_PIECE_BYTES < big.nbytes
    assert digest == digest_local_file(tmp_path / "state.pt")  # the pieces hashed in order
    assert torch.equal(load_state(tmp_path / "state.pt")["big"], big)
