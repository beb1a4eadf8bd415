"""The code blocks of the README and the guides in docs/ that tests execute.

A block is found by its info string (```` ```python trainer-integration ````) in whichever of
those files holds it, so a block keeps being executed when it moves from one to another; a tag
must stay unique across them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def block(info: str) -> str:
    """The body of the one block whose info string is ``info`` (e.g. ``"bash tls-certs"``)."""
    return _one(rf"```{re.escape(info)}\n(.*?)```", info)


def text_block(first_line: str) -> str:
    """The body of the one ```` ```text ```` block that starts with ``first_line``."""
    return _one(rf"```text\n({re.escape(first_line)}.*?)```", f"text block {first_line!r}")


def _one(pattern: str, what: str) -> str:
    found = [(path.name, m.group(1)) for path in doc_files() if path.exists()
             for m in re.finditer(pattern, path.read_text(), re.S)]
    assert len(found) == 1, (f"expected one ```{what}``` block in README.md / docs/*.md, found "
                             f"{[name for name, _ in found]}")
    return found[0][1]
