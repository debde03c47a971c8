"""The Python blocks of README.md and docs/*.md, by the marker before each one.

Every ```python block is preceded by one HTML comment (invisible on the rendered page):

* ``<!-- run: <id> -->``: a test runs the block's own text (tests/test_doc_blocks.py, or the
  test its table names), completing a fragment only with what it names but does not define;
* ``<!-- not run: <why> -->``: the block cannot run on a CPU, and the comment says why.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
MARK = re.compile(r"<!--\s*(run|not run):\s*(.*?)\s*-->\s*$")


class Block(NamedTuple):
    path: str           # relative to the repository root
    line: int           # of the block's first code line
    kind: Optional[str]     # "run", "not run", or None (unmarked)
    value: str          # the run id, or why it is not run
    code: str


def doc_files() -> List[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(text: str, path: str = "") -> List[Block]:
    out = []
    for m in BLOCK.finditer(text):
        before = text[:m.start()].rstrip().splitlines()     # a block in a list item is indented
        mark = MARK.match(before[-1].strip()) if before else None
        line = text[:m.start(1)].count("\n") + 1
        fence = text[text.rfind("\n", 0, m.start()) + 1:m.start()]     # a list item's indentation, or ""
        body = "".join(ln[len(fence):] if ln.startswith(fence) else ln for ln in m.group(1).splitlines(True))
        out.append(Block(path, line, mark.group(1) if mark else None, mark.group(2) if mark else "", body))
    return out


def all_blocks() -> List[Block]:
    return [b for p in doc_files() for b in blocks_of(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]


def runs() -> Dict[str, Block]:
    """run id -> its block (an id marks one block only)."""
    out: Dict[str, Block] = {}
    for b in all_blocks():
        if b.kind == "run":
            assert b.value not in out, f"{b.path}:{b.line}: run id {b.value!r} also marks {out[b.value].path}"
            out[b.value] = b
    return out


def code(block_id: str) -> str:
    """The text of the block marked ``<!-- run: block_id -->``."""
    return runs()[block_id].code
