"""The CI gates (`.ci/run` after the suite): lint, format, types and layers each fail on their own error.

Each test plants one error of its kind in a temporary copy and checks that the gate's command, as
`.ci/run` runs it, exits non-zero and names the error; the real tree passes the layer contracts.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GATES = ("ruff check .", "ruff format --check .", "mypy", "lint-imports")


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=300, env={"PATH": str(BIN), **env}
    )


def test_ci_runs_every_gate_after_the_readme_command():
    script = (REPO / ".ci" / "run").read_text()
    after = script[script.index("# --- README test command (end)") :]
    lines = [line.strip() for line in after.splitlines()]
    assert [gate for gate in GATES if gate in lines] == list(GATES)
    assert "set -euo pipefail" in script  # a failing gate fails the run


def test_ruff_check_fails_on_a_lint_error(tmp_path: Path):
    (tmp_path / "planted.py").write_text("import os\n")
    result = run([str(BIN / "ruff"), "check", "--no-cache", "planted.py"], tmp_path)
    assert result.returncode != 0
    assert "F401" in result.stdout


def test_ruff_format_check_fails_on_unformatted_code(tmp_path: Path):
    (tmp_path / "planted.py").write_text("x = {  'a':1 }\n")
    result = run([str(BIN / "ruff"), "format", "--check", "--no-cache", "planted.py"], tmp_path)
    assert result.returncode != 0
    assert "planted.py" in result.stdout


def test_mypy_fails_on_a_type_error_with_the_project_settings(tmp_path: Path):
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    package = tmp_path / "spot_callbacks"
    package.mkdir()
    (package / "__init__.py").write_text("def steps() -> int:\n    return 'twelve'\n")
    result = run([sys.executable, "-m", "mypy", "--no-incremental"], tmp_path)
    assert result.returncode != 0
    assert 'Incompatible return value type (got "str", expected "int")' in result.stdout


def test_the_layer_contracts_hold_and_fail_on_an_upward_import(tmp_path: Path):
    kept = run([str(BIN / "lint-imports"), "--no-cache"], REPO, PYTHONPATH=str(REPO))
    assert kept.returncode == 0, kept.stdout + kept.stderr
    shutil.copytree(
        REPO / "spot_callbacks", tmp_path / "spot_callbacks", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    layout = tmp_path / "spot_callbacks" / "store" / "layout.py"
    layout.write_text(
        layout.read_text() + "\nimport spot_callbacks.engine  # planted: the store imports the engine\n"
    )
    broken = run([str(BIN / "lint-imports"), "--no-cache"], tmp_path, PYTHONPATH=str(tmp_path))
    assert broken.returncode != 0
    assert "spot_callbacks.store.layout -> spot_callbacks.engine" in broken.stdout


@pytest.mark.parametrize("gate", ["ruff check .", "ruff format --check ."])
def test_the_tree_passes_the_lint_gates(gate: str):
    result = run([str(BIN / gate.split()[0]), *gate.split()[1:]], REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_failed_install_step_stops_the_run_before_the_gates(tmp_path: Path):
    """`set -e` skips a failure before the last `&&` of a list: the README command's own status is
    checked, so CI never passes on its gates alone with no test run."""
    script = (REPO / ".ci" / "run").read_text()
    readme_block = script[script.index("# --- README test command (begin)") : script.index('echo "--- lint')]
    planted = tmp_path / "run"
    planted.write_text(
        "set -euo pipefail\npip() { return 7; }\nnpm() { return 0; }\n"
        + readme_block
        + "echo GATES-REACHED\n"
    )
    result = subprocess.run(["bash", str(planted)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "GATES-REACHED" not in result.stdout
    assert "before the tests ran" in result.stderr
