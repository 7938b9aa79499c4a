"""The backend table (store/backends.py): one row per protocol family, asked by every module.

A new backend is a row plus its client module: a row added here is what the data plane, the
region check, the fail-fast checks and the diagnosis see, and no other module spells a protocol.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import tomllib
from fsspec.implementations.memory import MemoryFileSystem
from helpers.code_strings import code_strings

import spot_callbacks
import spot_callbacks.store.backends as backends
from spot_callbacks.accounting.region import Placement, RegionCheck, bucket_placement
from spot_callbacks.errors import UnknownStoreError
from spot_callbacks.store.backends import BACKENDS, Backend, backend_of, backend_of_fs, load
from spot_callbacks.store.dataplane import FsspecPlane, select_data_plane
from spot_callbacks.store.diagnosis import diagnose
from spot_callbacks.store.resolve import check_protocol

PACKAGE = Path(spot_callbacks.__file__).parent
TABLE = PACKAGE / "store" / "backends.py"
# A backend's client module speaks its SDK's names (boto3's service is "s3").
CLIENTS = PACKAGE / "store" / "clients"
# Words that are also protocol names, used here for something else: an fsspec listing entry's type,
# the notice-file source, a progress bar's kind.
OTHER_MEANINGS = {
    "accounting/attempts.py": {"file"},
    "preemption/sources.py": {"file"},
    "progress.py": {"file"},
}


def spelled_protocols(source: str, protocols: set[str]) -> set[str]:
    """The protocol names ``source``'s code spells (as a string, or a ``<protocol>://`` URL in one);
    docstrings and comments are no code."""
    return {
        p for node in code_strings(source) for p in protocols if node.value == p or f"{p}://" in node.value
    }


def test_every_protocol_has_one_row_and_every_row_is_whole():
    protocols = [p for backend in BACKENDS for p in backend.protocols]
    assert len(protocols) == len(set(protocols))  # a protocol in two rows would have two answers
    extras = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for backend in BACKENDS:
        assert backend.protocols[0] == backend.family
        assert all(backend_of(p) is backend for p in backend.protocols)
        if backend.extra is not None:  # the install hint names an extra that installs the package
            assert any(dep.startswith(backend.package or "?") for dep in extras[backend.extra]), (
                backend.family
            )
        if backend.bucket_region is not None:
            assert callable(load(backend.bucket_region))
        assert backend.data_plane is None or backend.no_data_plane is None  # one or the other
    assert backend_of("hdfs") == Backend("hdfs", ("hdfs",))  # not in the table: nothing promised


def test_no_module_but_the_table_spells_a_protocol():
    protocols = {p for backend in BACKENDS for p in backend.protocols}
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == TABLE or CLIENTS in path.parents:
            continue
        name = path.relative_to(PACKAGE).as_posix()
        spelled = spelled_protocols(path.read_text(), protocols) - OTHER_MEANINGS.get(name, set())
        if spelled:
            offenders[name] = sorted(spelled)
    assert offenders == {}, "ask store/backends.py (backend_of, backend_of_fs, family_of) instead"
    # The scan sees code, not prose: it can fail.
    code = '"""s3://bucket in a docstring"""\n# "gcs" in a comment\nif protocol in ("s3a", "x"): url = f"az://{b}"\n'
    assert spelled_protocols(code, protocols) == {"s3a", "az"}


class RowFileSystem(MemoryFileSystem):
    """An in-memory filesystem under a protocol no row knows yet: the backend a maintainer adds."""

    protocol = ("spotrow", "spotrowa")


class RowPlane(FsspecPlane):
    pass


def placement_of(fs: Any, bucket: str) -> Placement | None:
    return Placement("aws", f"region-of-{bucket}")


@pytest.fixture
def new_row(monkeypatch: pytest.MonkeyPatch) -> Backend:
    """One row added to the table, as a new backend is added: nothing else changes."""

    def plane(fs: Any, budget: Any, choice: str) -> RowPlane:
        return RowPlane(fs)

    row = Backend(
        "spotrow",
        ("spotrow", "spotrowa"),
        package="spotrowfs",
        extra="spotrow",
        bucketed=True,
        container="vault",
        data_plane=plane,
        data_plane_choices=("obstore",),
        bucket_region=f"{__name__}:placement_of",
        no_credentials_fix="set SPOTROW_TOKEN",
        conditional_writes="etag",
    )
    monkeypatch.setattr(backends, "BACKENDS", (*BACKENDS, row))
    for protocol in row.protocols:
        monkeypatch.setitem(backends._BY_PROTOCOL, protocol, row)
    return row


def test_a_new_row_is_what_every_module_asks(new_row: Backend):
    fs = RowFileSystem(skip_instance_cache=True)
    assert backend_of_fs(fs) is new_row and backends.family_of("spotrowa") == "spotrow"
    # The data plane: the row's fast client, and a $SPOT_DATA_PLANE choice it does not honour refused.
    assert isinstance(select_data_plane(fs, {}), RowPlane)
    refused = select_data_plane(fs, {"SPOT_DATA_PLANE": "boto3"})
    assert (
        isinstance(refused, FsspecPlane)
        and refused.reason == "SPOT_DATA_PLANE=boto3, and boto3 speaks s3:// only"
    )
    # The region check: the row's lookup.
    assert bucket_placement(fs, "vault-1/run") == Placement("aws", "region-of-vault-1")
    # What the store promises, and the diagnosis.
    assert backends.conditional_writes(fs.protocol) == "etag"
    assert diagnose(FileNotFoundError("gone"), "spotrow", "v").cause == "the vault 'v' does not exist"
    assert diagnose(ValueError("Unable to locate credentials"), "spotrowa", "v").fix == "set SPOTROW_TOKEN"


def test_a_protocol_without_a_row_leaves_bytes_and_regions_alone():
    fs = RowFileSystem(skip_instance_cache=True)
    assert backend_of_fs(fs).data_plane is None  # no row: fsspec's backend as it is
    assert select_data_plane(fs, {}).reason is None
    assert bucket_placement(fs, "vault-1/run") is None
    check = RegionCheck(fs, "vault-1/run", "spotrow://vault-1/run")
    assert check.compare() is None  # nothing asked of a metadata service either


def test_an_unknown_protocol_is_told_the_rows_that_can_be_installed():
    with pytest.raises(UnknownStoreError) as raised:
        check_protocol("s4://b/run", "s4")
    extras = [backend.extra for backend in BACKENDS if backend.extra]
    assert extras == ["s3", "gcs", "azure"]  # docs/troubleshooting.md quotes the message
    assert "did you mean s3://? use s3://, gs://, az:// or a local path; " in str(raised.value)
    assert "pip install 'spot-callbacks[s3]' (or [gcs], [azure]) adds a cloud backend" in str(raised.value)
