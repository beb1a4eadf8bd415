"""Rules every guide keeps, so a newcomer can paste its commands into a fresh clone.

A newcomer found `rollout ...` lines that answer "command not found" (the command lives in the
set-up's `.venv`), and guides that named the wrong set-up script for what it installs.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDES = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])
SUBCOMMANDS = ("serve", "train", "jobs", "submit", "tasks", "bench", "quickstart", "status",
               "llm-serve", "backends")
BARE = re.compile(r"^\s*(\$ )?rollout (" + "|".join(SUBCOMMANDS) + r")\b")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    out, inside = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            out.append((n, line))
    return out


def test_guides_run_the_command_from_the_set_up_venv() -> None:
    bare = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in GUIDES
            for n, line in _code_lines(p) if BARE.match(line)]
    assert not bare, "write .venv/bin/rollout (what scripts/setup.sh installs):\n" + "\n".join(
        bare)


def test_the_rule_sees_a_bare_command() -> None:
    assert BARE.match("rollout serve --port 1")
    assert BARE.match("$ rollout jobs list")
    assert not BARE.match(".venv/bin/rollout serve")
    assert not BARE.match("rollout service listening on 127.0.0.1:50051")


def test_guides_name_the_set_up_script_that_installs_the_test_pieces() -> None:
    """Harnesses, the browser and the trainer venvs come from scripts/setup_test.sh (the test
    command's set-up); scripts/setup.sh installs only what the main job needs."""
    setup = (ROOT / "scripts/setup.sh").read_text()
    wrong = []
    for piece in ("setup_harnesses.sh", "setup_browser.sh", "setup_adapters.sh",
                  "setup_vllm.sh"):
        assert piece not in setup, f"{piece} moved into setup.sh: update this test"
        for p in GUIDES:
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if piece in line and re.search(r"(part of|called by|run by) `scripts/setup\.sh`",
                                               line):
                    wrong.append(f"{p.relative_to(ROOT)}:{n}")
    assert not wrong, wrong
