"""docs/architecture.md's module map lists every file of the package (and no file that is gone)."""

from __future__ import annotations

import re
from pathlib import Path

import spot_callbacks

PACKAGE = Path(spot_callbacks.__file__).parent
DOC = PACKAGE.parent / "docs" / "architecture.md"


def mapped_files() -> set[str]:
    text = DOC.read_text()
    block = text[text.index("## Module map") :]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    found, folders = set(), []
    for line in block.splitlines()[1:]:  # the first line is spot_callbacks/
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        name = line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            continue
        names = re.split(r"\s{2,}", line.strip())[0]  # "x.py" or "aws.py, gcp.py, azure.py"
        for entry in re.findall(r"\w+\.py", names):
            found.add("/".join([*folders, entry]))
    return found


def test_the_module_map_lists_every_file_of_the_package():
    files = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")}
    mapped = mapped_files()
    assert sorted(files - mapped) == [], "files missing from docs/architecture.md's module map"
    assert sorted(mapped - files) == [], "files in docs/architecture.md's module map that do not exist"
