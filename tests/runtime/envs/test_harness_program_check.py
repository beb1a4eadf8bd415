"""The in-sandbox check of a harness's program (``in_sandbox/harness_program.py``), run as INIT
runs it, here against the host's root: the program is found past ``env`` / ``exec`` prefixes
and on ``PATH`` for a bare name, so an image that lacks its interpreter is refused at INIT
whatever way the command names it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout.runtime.envs.harness.handler import PROGRAM_CHECK_SOURCE


def verdict(words: list[str], path: Path) -> dict[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM_CHECK_SOURCE.read_text(), *words],
        capture_output=True, text=True, timeout=60, check=True,
        env={"PATH": f"{path}:/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def agent(tmp_path: Path) -> Path:
    """A program on PATH whose ``#!`` interpreter this root does not have."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "my-agent"
    program.write_text("#!/no/such/interpreter\n")
    program.chmod(0o755)
    return program


@pytest.mark.parametrize("words", [
    ["{path}"],
    ["my-agent", "--task", "t"],
    ["env", "X=1", "my-agent"],
    ["env", "-i", "-u", "HOME", "X=1", "my-agent", "-v"],
    ["/usr/bin/env", "my-agent"],
    ["exec", "my-agent"],
    ["FOO=bar", "my-agent"],
])
def test_the_program_is_found_however_the_command_names_it(agent: Path,
                                                          words: list[str]) -> None:
    words = [w.replace("{path}", str(agent)) for w in words]
    assert verdict(words, agent.parent) == {
        "missing": "/no/such/interpreter", "needed_by": str(agent)}


def test_a_program_that_can_start_or_is_not_found_passes_the_check_to_run(agent: Path) -> None:
    assert verdict(["env", "X=1", "python3", "-c", "pass"], agent.parent) == {}
    # Not found at all: the install's fault, which RUN's own start reports.
    assert verdict(["no-such-agent"], agent.parent) == {
        "missing": "no-such-agent", "needed_by": "the harness command"}
    assert verdict(["{install}/bin/agent"], agent.parent) == {}
