"""The docs: a short README, the docs site under docs/ (mkdocs.yml), and the API reference's coverage.

README keeps what a newcomer needs (the two commands, both quickstarts, links); every other page
lives under docs/ and is built by ``mkdocs build --strict`` in .ci/run. These tests keep the
promises a build alone cannot: the commands CI runs, every public name in the API reference, every
test a page cites still there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PUBLIC_MODULES = ("spot_callbacks", "spot_callbacks.lightning", "spot_callbacks.hf")
FIRST_COMMAND = (
    'pip install torch==2.13.0 && pip install -e ".[lightning]" && python examples/lightning_spot.py'
)


def _nav_pages(nav: list[Any]) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _mkdocs_config() -> dict[str, Any]:
    # mkdocs.yml has no custom tags (no !ENV, no !!python/name): a plain YAML read.
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _doc_pages() -> list[Path]:
    return sorted(path for path in DOCS.rglob("*.md") if "_ext" not in path.relative_to(DOCS).parts)


def _ci_run_command() -> str:
    ci_run = (ROOT / ".ci" / "run").read_text()
    block = re.search(
        r"# --- README test command \(begin\)[^\n]*\n(.*?)\n# --- README test command \(end\)", ci_run, re.S
    )
    assert block, ".ci/run lost its README test command block (begin/end markers)"
    return block.group(1).strip()


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move the detail to a page under docs/"


def test_the_two_commands_at_the_top_of_readme_are_unchanged_and_ci_runs_the_second():
    text = README.read_text()
    block = re.search(r"```bash\n(.*?)\n```", text, re.S)
    assert block, "README.md lost its first ```bash block (the two commands)"
    assert block.group(1).splitlines() == [FIRST_COMMAND, _ci_run_command()]
    assert text.index(block.group(0)) < text.index("\n## "), (
        "the two commands must come before the first section"
    )


def test_ci_builds_the_docs_after_the_test_command_block():
    ci_run = (ROOT / ".ci" / "run").read_text()
    end = ci_run.index("# --- README test command (end)")
    assert "NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir site" in ci_run[end:]
    assert "/site/" in (ROOT / ".gitignore").read_text().splitlines()


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages(_mkdocs_config()["nav"])
    missing = [page for page in nav if not (DOCS / page).is_file()]
    assert missing == [], f"mkdocs.yml's nav names pages that do not exist: {missing}"
    unlisted = [
        str(path.relative_to(DOCS)) for path in _doc_pages() if str(path.relative_to(DOCS)) not in nav
    ]
    assert unlisted == [], f"pages under docs/ that mkdocs.yml's nav does not list: {unlisted}"


def test_readme_links_to_files_that_exist():
    # mkdocs checks the links between pages; README is not one of them.
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [target for target in targets if "://" not in target]
    assert local, "README.md links to no page under docs/"
    assert [target for target in local if not (ROOT / target).exists()] == []


def _resolve(path: str) -> object:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise AssertionError(f"'::: {path}' in docs/api names nothing importable")


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_export_has_an_api_entry(module_name):
    module: ModuleType = importlib.import_module(module_name)
    directives = [
        line.split(":::", 1)[1].strip()
        for page in sorted((DOCS / "api").glob("*.md"))
        for line in page.read_text().splitlines()
        if line.startswith(":::")
    ]
    missing = [
        name
        for name in module.__all__
        if not any(
            _resolve(path) is getattr(module, name) for path in directives if path.rsplit(".", 1)[-1] == name
        )
    ]
    assert missing == [], f"{module_name} exports names no '::: ...' entry in docs/api documents: {missing}"


def test_every_test_a_page_cites_exists():
    test_sources = {path.name: path.read_text() for path in (ROOT / "tests").rglob("*.py")}
    defined = {name for text in test_sources.values() for name in re.findall(r"def (test_\w+)", text)}
    stale = []
    for page in [README, *_doc_pages()]:
        text = page.read_text()
        for name in set(re.findall(r"`(test_\w+)", text)) - defined:
            stale.append(f"{page.relative_to(ROOT)}: {name}")
        for path in set(re.findall(r"tests/([\w/]+\.py)", text)):
            if not (ROOT / "tests" / path).is_file():
                stale.append(f"{page.relative_to(ROOT)}: tests/{path}")
    assert stale == [], f"pages cite tests that do not exist (renamed? update the page): {stale}"


def test_the_reference_extension_turns_roles_into_code_and_example_into_examples():
    spec = importlib.util.spec_from_file_location("griffe_examples", DOCS / "_ext" / "griffe_examples.py")
    assert spec and spec.loader
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    text = "See :class:`~spot_callbacks.errors.SpotError` and :func:`parse_duration`.\n\n    Example:\n        >>> 1\n        1"
    assert extension.markdown_docstring(text) == (
        "See `SpotError` and `parse_duration`.\n\n    Examples:\n        >>> 1\n        1"
    )


def test_mkdocs_build_strict_passes(tmp_path):
    # The dev extra installs mkdocs-material and mkdocstrings: a missing one fails here, not skips.
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, check=False, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "api" / "core" / "index.html").is_file()
