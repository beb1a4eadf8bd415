"""The harness environment's task checks: a bad payload is refused at submit with the field to
fix; a user's preset directory adds a harness without touching the server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harness import presets as harness_presets
from rollout.runtime.envs.harness.handler import HarnessHandler, launch_spec
from rollout.runtime.handler import JobContext
from rollout.runtime.types import InvalidArgument, JobSpec, Limits, SamplingParams
from tests.runtime.envs.conftest import Rollout
from tests.runtime.envs.harness_helpers import PING_REPLY, PingGateway, harness_task

MATH = {"question": "What is 1 + 1?", "answer": "2", "tools": []}


def refused(task: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        HarnessHandler().validate_task(task)
    return info.value


@pytest.mark.parametrize(("task", "field", "words"), [
    ({"task": MATH, "harness": "mini-swe-agent"}, "task.environment", "environment"),
    (harness_task("short", MATH, "mini-swe-agent"), "task.environment", "swe"),
    (harness_task("math", {"answer": "2"}, "mini-swe-agent"), "task.task.question",
     "question"),
    (harness_task("math", MATH, "no-such-harness"), "task.harness", "unknown harness preset"),
    (harness_task("math", MATH, {"command": "ls"}), "task.harness.command", "list of strings"),
    (harness_task("math", MATH, {"command": ["x"], "port": 80}), "task.harness.port", "1024"),
    (harness_task("math", MATH, {"command": ["x"], "files": {"rel.txt": "x"}}),
     "task.harness.files", "absolute"),
    (harness_task("math", MATH, {"preset": "codex", "command": ["x"]}), "task.harness",
     "override only 'env'"),
    (harness_task("math", MATH, {"command": ["x"], "install": "/definitely/not/here"}),
     "task.harness", "not installed"),
    (harness_task("math", MATH, {"command": ["x"]}, model="bad model name"), "task.model",
     "model name"),
    ({**harness_task("math", MATH, {"command": ["x"]}), "extra": 1}, "task", "unknown fields"),
    (harness_task("math", MATH, {"command": ["x"], "limits": {"threads": 9}}),
     "task.harness.limits", "unknown fields ['threads']"),
    (harness_task("math", MATH, {"command": ["x"], "limits": {"address_space": "4 parsecs"}}),
     "task.harness.limits.address_space", "16GiB"),
    (harness_task("math", MATH, {"command": ["x"], "limits": {"processes": 0}}),
     "task.harness.limits.processes", "positive integer"),
    (harness_task("math", MATH, {"command": ["x"], "limits": 5}), "task.harness.limits",
     "must be a table"),
    (harness_task("math", MATH, {"command": ["x"], "side_call": [{}]}),
     "task.harness.side_call", "needs model, system, metadata or last_user"),
    (harness_task("math", MATH, {"command": ["x"], "side_call": [{"model": "("}]}),
     "task.harness.side_call", "not a regular expression"),
    (harness_task("math", MATH, {"command": ["x"], "side_call": [{"modle": "x"}]}),
     "task.harness.side_call", "unknown fields ['modle']"),
    (harness_task("math", MATH, {"command": ["x"], "side_call": {"model": "x"}}),
     "task.harness.side_call", "list of tables"),
])
def test_bad_tasks_are_refused_naming_the_field(task: Any, field: str, words: str) -> None:
    error = refused(task)
    assert error.field == field, (error.field, str(error))
    assert words in str(error)


def test_a_preset_that_is_not_installed_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUT_SETUP_CACHE", str(tmp_path))
    error = refused(harness_task("math", MATH, "mini-swe-agent"))
    assert "setup_harnesses.sh" in str(error)


def test_placeholders_are_filled_and_other_braces_kept() -> None:
    spec = harness_presets.HarnessSpec(
        "t", ("run", "{model}", "--steps={max_steps}", '{"json": {}}'), None,
        env={"URL": "{base_url}", "KEY": "{api_key}"},
        files={"{home}/c.toml": "url = '{origin}' x = {unknown}"}, port=4321)
    spec_obj = JobSpec(job_id="j", environment="harness",
                       task=harness_task("math", MATH, "codex", model="m-1"),
                       limits=Limits(max_turns=7), sampling=SamplingParams())
    launch = launch_spec(JobContext(spec=spec_obj), spec, "rk-key", "/workspace", "/tmp/home")
    assert launch["argv"] == ["run", "m-1", "--steps=7", '{"json": {}}']
    assert launch["env"]["URL"] == "http://127.0.0.1:4321/v1"
    assert launch["env"]["OPENAI_API_KEY"] == launch["env"]["KEY"] == "rk-key"
    assert launch["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:4321"
    assert launch["files"]["/tmp/home/c.toml"] == "url = 'http://127.0.0.1:4321' x = {unknown}"
    assert "answer.txt" in launch["files"]["/tmp/.rollout-harness-prompt.txt"]


async def test_a_users_preset_directory_adds_a_harness(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install = tmp_path / "my-agent"
    install.mkdir()
    (install / "agent.py").write_text(
        "import json, os, sys, urllib.request\n"
        "req = urllib.request.Request(os.environ['AGENT_URL'] + '/models', headers={\n"
        "    'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})\n"
        "print('MODELS', urllib.request.urlopen(req, timeout=10).read().decode())\n"
        "open('answer.txt', 'w').write(sys.argv[1])\n")
    install.chmod(0o755)
    (install / "agent.py").chmod(0o644)
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "my-agent.toml").write_text(
        f'install = "{install}"\n'
        'command = ["python", "{install}/agent.py", "2"]\n'
        '[env]\nAGENT_URL = "{base_url}"\n')
    monkeypatch.setenv("ROLLOUT_HARNESS_PRESETS", str(presets))
    assert "my-agent" in harness_presets.preset_names()
    result = await rollout(HarnessHandler(), harness_task("math", MATH, "my-agent"), [],
                           gateway=PingGateway(), limits=Limits(max_turns=2, run_timeout_s=60))
    log = result.outcome.metadata["harness_log"]
    assert json.loads(log.split("MODELS ", 1)[1].splitlines()[0]) == PING_REPLY
    assert result.reward.value == 1.0


def test_side_call_rules_and_limits_are_read_from_a_preset() -> None:
    spec = harness_presets.resolve({
        "command": ["x"], "limits": {"address_space": "16GiB", "processes": 1024},
        "side_call": [{"model": "claude-.*-haiku.*"},
                      {"system": "(?i)title", "metadata": {"purpose": "title"}}]})
    assert spec.limits == {"address_space_bytes": 16 << 30, "processes": 1024}
    first, second = spec.side_calls
    assert first.matches("claude-3-5-haiku-20241022", "", {})
    assert not first.matches("policy", "", {})
    assert second.matches("m", "Write a TITLE", {"purpose": "title"})
    assert not second.matches("m", "Write a TITLE", {})


async def test_a_preset_raises_its_sandbox_limits_within_the_servers_ceilings(
        rollout: Rollout) -> None:
    """The harness and everything it starts run under the limits its preset asks for, each
    cut to the server's ceiling; other jobs keep the defaults."""
    from rollout.runtime.sandbox.base import DEFAULT_MAX_LIMITS, SandboxLimits

    probe = ["bash", "-c", "grep -E 'address space|processes|open files' /proc/self/limits; "
             "echo 2 > answer.txt"]
    harness = {"command": probe, "limits": {"address_space": "1024GiB", "processes": 1000,
                                            "open_files": 4096}}
    result = await rollout(HarnessHandler(), harness_task("math", MATH, harness), [],
                           gateway=PingGateway(), limits=Limits(max_turns=2, run_timeout_s=60))
    log = result.outcome.metadata["harness_log"]
    rows = {line.split("  ")[0]: line.split()[-3] for line in log.splitlines()
            if line.startswith("Max ")}
    assert rows == {"Max address space": str(DEFAULT_MAX_LIMITS.address_space_bytes),
                    "Max processes": "1000", "Max open files": "4096"}, log
    assert "processes=1000" in result.outcome.metadata["harness_limits"]
    plain = await rollout(HarnessHandler(), harness_task("math", MATH, {"command": probe}), [],
                          gateway=PingGateway(), limits=Limits(max_turns=2, run_timeout_s=60))
    assert f"Max processes             {SandboxLimits().processes}" in \
        plain.outcome.metadata["harness_log"]
    assert "harness_limits" not in plain.outcome.metadata


async def test_a_sandbox_above_the_servers_ceilings_is_refused(sandbox_factory: Any) -> None:
    from rollout.runtime.sandbox.base import SandboxError, SandboxLimits

    with pytest.raises(SandboxError, match=r"ceilings.*processes 100000 > 4096"):
        await sandbox_factory(limits=SandboxLimits(processes=100_000))
