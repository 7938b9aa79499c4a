"""The package's layout keeps the measures docs/architecture.md promises.

No import cycle (function-level imports included), a root that exports the public contract only,
and no logging configured by an import. The layers themselves are import-linter contracts
(`.importlinter`, run by `.ci/run` and by tests/test_ci_gates.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import spot_callbacks
from spot_callbacks import errors

PACKAGE = Path(spot_callbacks.__file__).parent
MAX_ROOT_NAMES = 10  # besides the error classes


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Every package module ``name`` imports, at any depth of its code, ``TYPE_CHECKING`` blocks
    included: a type-only import is still an arrow of responsibility (DESIGN: no cycle of any kind)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # `from spot_callbacks.store import x` runs spot_callbacks/store/__init__.py: count the package.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycle_inside_the_package():
    known = modules()
    graph = {name: imported_modules(name, path, set(known)) for name, path in known.items()}
    # A package's __init__ may re-export its submodules; a submodule then imports its siblings, never
    # the package (that edge closes a cycle through the __init__, as any other would).
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_root_exports_the_public_contract_only():
    error_names = {name for name in errors.__all__}
    others = [name for name in spot_callbacks.__all__ if name not in error_names]
    assert len(others) <= MAX_ROOT_NAMES, others
    for name in spot_callbacks.__all__:  # every exported name resolves (the lazy ones included)
        assert getattr(spot_callbacks, name) is not None


def test_importing_the_package_configures_no_logging():
    probe = (
        "import logging, sys\n"
        "before = {n: list(l.handlers) for n, l in logging.root.manager.loggerDict.items() if hasattr(l, 'handlers')}\n"
        "import spot_callbacks, spot_callbacks.store, spot_callbacks.cli\n"
        "import spot_callbacks.lightning, spot_callbacks.hf\n"
        "root = logging.getLogger()\n"
        "ours = logging.getLogger('spot_callbacks')\n"
        "assert root.handlers == [], root.handlers\n"
        "assert all(type(h) is logging.NullHandler for h in ours.handlers), ours.handlers\n"
        "assert ours.propagate and ours.level == logging.NOTSET\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


def test_a_callback_shows_info_lines_only_when_the_application_configured_no_logging(tmp_path):
    probe = (
        "import logging, sys\n"
        "configured = sys.argv[1] == 'configured'\n"
        "if configured:\n"
        "    logging.basicConfig(level=logging.WARNING)\n"
        "from spot_callbacks.lightning import SpotCheckpoint\n"
        f"SpotCheckpoint(dirpath={str(tmp_path / 'run')!r}, preemption=[])\n"
        "ours = logging.getLogger('spot_callbacks')\n"
        "added = [h for h in ours.handlers if type(h) is not logging.NullHandler]\n"
        "print(len(added), ours.propagate, logging.getLevelName(ours.getEffectiveLevel()))\n"
    )
    results = {}
    for mode in ("configured", "bare"):
        run = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        results[mode] = run.stdout.split()
    assert results["configured"] == ["0", "True", "WARNING"]  # the application's choice stands
    assert results["bare"] == ["1", "False", "INFO"]  # else, as Lightning does: info lines on stderr
