"""Smoke tests of the test infrastructure: real fsspec round trips against every store backend.

These do not import spot_callbacks; they check that the servers started by conftest.py behave
like object stores (data survives a round trip, listings are exact, deletes are real).
"""

from __future__ import annotations

import os
import posixpath

from conftest import StoreTarget, fs_for

LARGE_SIZE = 12 * 1024 * 1024 + 12345  # not a multiple of any block/chunk size


def _relative(root: str, paths: list[str]) -> set[str]:
    root = root.rstrip("/")
    out = set()
    for p in paths:
        p = p.rstrip("/")
        assert p.startswith(root + "/"), f"{p!r} is not below the test root {root!r}"
        out.add(p[len(root) + 1 :])
    return out


def test_pipe_cat_and_missing_keys(store_url: StoreTarget) -> None:
    fs, root = fs_for(store_url)
    payload = os.urandom(4096) + b"\x00end"
    key = posixpath.join(root, "dir", "blob.bin")

    fs.makedirs(posixpath.dirname(key), exist_ok=True)  # needed for file://, no-op elsewhere
    fs.pipe(key, payload)
    assert fs.cat(key) == payload
    assert fs.info(key)["size"] == len(payload)
    # Overwrite must replace, not append or keep the old body.
    fs.pipe(key, b"second")
    assert fs.cat(key) == b"second"

    fs.invalidate_cache()
    assert fs.exists(key)
    assert not fs.exists(posixpath.join(root, "dir", "never-written.bin"))
    assert not fs.exists(posixpath.join(root, "no-such-dir", "never-written.bin"))


def test_put_get_large_file(store_url: StoreTarget, tmp_path) -> None:
    fs, root = fs_for(store_url)
    src = tmp_path / "src.bin"
    data = os.urandom(LARGE_SIZE)
    src.write_bytes(data)
    key = posixpath.join(root, "ckpt", "model.pt")

    fs.makedirs(posixpath.dirname(key), exist_ok=True)
    fs.put_file(str(src), key)
    fs.invalidate_cache()
    assert fs.info(key)["size"] == LARGE_SIZE

    dst = tmp_path / "dst.bin"
    fs.get_file(key, str(dst))
    assert dst.stat().st_size == LARGE_SIZE
    assert dst.read_bytes() == data

    # An independent client (no shared instance or caches) sees the same object.
    other, _ = fs_for(store_url, fresh=True)
    assert other is not fs
    assert other.info(key)["size"] == LARGE_SIZE
    assert other.cat_file(key, start=LARGE_SIZE - 100) == data[-100:]


def test_find_exact_then_rm_recursive(store_url: StoreTarget) -> None:
    fs, root = fs_for(store_url)
    written = {
        "a.txt",
        "sub/b.txt",
        "sub/deeper/c.txt",
        "sub/deeper/d.bin",
        "other/e.txt",
    }
    for i, rel in enumerate(sorted(written)):
        fs.makedirs(posixpath.dirname(posixpath.join(root, rel)), exist_ok=True)
        fs.pipe(posixpath.join(root, rel), f"payload {i}".encode())

    fs.invalidate_cache()
    assert _relative(root, fs.find(root)) == written
    assert _relative(root, fs.find(posixpath.join(root, "sub"))) == {
        "sub/b.txt",
        "sub/deeper/c.txt",
        "sub/deeper/d.bin",
    }
    # A sibling root with a shared name prefix must not leak into the listing.
    sibling = root.rstrip("/") + "-sibling"
    fs.makedirs(sibling, exist_ok=True)
    fs.pipe(posixpath.join(sibling, "x.txt"), b"x")
    fs.invalidate_cache()
    assert _relative(root, fs.find(root)) == written

    fs.rm(root, recursive=True)
    fs.rm(sibling, recursive=True)
    fs.invalidate_cache()
    assert fs.find(root) == []
    assert fs_for(store_url, fresh=True)[0].find(root) == []
    for rel in written:
        assert not fs.exists(posixpath.join(root, rel)), rel
    assert not fs.exists(root)
    assert not fs.exists(sibling)
