"""settings.py: one table of SPOT_* knobs, the docs' configuration page in step with it, os.environ read nowhere else."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import spot_callbacks
from spot_callbacks import ConfigError, SpotConfig, SpotError, settings
from spot_callbacks.engine import SpotEngine

ROOT = Path(__file__).resolve().parent.parent


def test_every_knob_the_package_names_is_in_the_table_and_on_the_configuration_page():
    package = Path(spot_callbacks.__file__).parent
    named = set()
    for path in package.rglob("*.py"):
        named |= set(re.findall(r"\bSPOT_[A-Z][A-Z0-9_]*\b", path.read_text()))
    named -= {"SPOT_EXAMPLE_S"}  # settings.py's doctest
    assert named <= set(settings.KNOBS), sorted(named - set(settings.KNOBS))
    page = (ROOT / "docs" / "configuration.md").read_text()
    for knob in settings.KNOBS.values():
        assert knob.readme_row in page, (
            f"docs/configuration.md's knob table lacks (or has an old row of) {knob.name}: "
            "paste its row from spot_callbacks.settings.readme_table()"
        )


def test_only_settings_reads_the_environment():
    found = subprocess.run(
        ["grep", "-rn", "os.environ", str(Path(spot_callbacks.__file__).parent)],
        capture_output=True, text=True, check=False,
    ).stdout.splitlines()  # fmt: skip
    readers = [
        line for line in found
        if "/settings.py:" not in line and not re.search(r"os\.environ\[[^]]+\] = |``os\.environ``|>>> ", line)
    ]  # fmt: skip
    assert readers == []


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SPOT_SIGNAL_GRACE_S", "30 fortnights", "SPOT_SIGNAL_GRACE_S='30 fortnights' is not a duration"),
        ("SPOT_METADATA_POLL_S", "-5", "SPOT_METADATA_POLL_S='-5' must be a positive duration"),
        ("SPOT_STRICT", "maybe", "SPOT_STRICT='maybe' is not a switch; use 1/true/yes/on or 0/false/no/off"),
        ("SPOT_MANIFEST_MAX_FILES", "lots", "SPOT_MANIFEST_MAX_FILES='lots' is not a positive whole number"),
        ("SPOT_HF_SAVE", "fast", "SPOT_HF_SAVE='fast': expected 'staged' or 'trainer'"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_it_when_the_engine_is_built(
    tmp_path, monkeypatch, name, value, expected
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(expected)) as failure:
        SpotEngine(SpotConfig(dirpath=str(tmp_path / "run"), preemption=[]), framework="lightning")
    assert isinstance(failure.value, SpotError) and isinstance(failure.value, ValueError)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_durations_and_switches_read_as_people_write_them(monkeypatch):
    monkeypatch.setenv("SPOT_LOCK_STALE_S", "2min")
    monkeypatch.setenv("SPOT_STORE_TIMEOUT_S", "off")
    monkeypatch.setenv("SPOT_PREFLIGHT", "no")
    assert settings.LOCK_STALE_S.value() == 120.0
    assert settings.STORE_TIMEOUT_S.value() is None
    assert settings.PREFLIGHT.value() is False
    monkeypatch.setenv("SPOT_PREFLIGHT", "")
    assert settings.PREFLIGHT.value() is True  # empty is unset: the default
