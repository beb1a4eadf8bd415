"""The `harbor` environment on real image sandboxes (the loopback registry's base image as
`python:3.11-slim`, Dockerfiles built daemonless): Harbor's oracle check over the fixture
tasks, a non-binary reward, a test that needs files the agent put in system paths, and what a
hostile policy can try against the verifier."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harbor.handler import HarborHandler
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.tasksets import harbor_import
from rollout.runtime.tasksets.shipped import main as tasks_main
from rollout.runtime.types import Limits
from tests.fixtures.images import Registry
from tests.runtime.envs.conftest import Rollout, call, in_order
from tests.runtime.envs.harbor_helpers import FIXTURES, image_factory, line
from tests.runtime.envs.harness_helpers import MSWEA_SUBMIT, harness_task, need_mini_swe_agent
from tests.runtime.envs.harness_helpers import mswea_action as action

pytestmark = pytest.mark.slow  # each task's image is built once per session (tens of seconds)
DONE = call("submit", answer="done")


@pytest.fixture(scope="module")
def harbor_images(shared_image_cache: Path, image_registry: Registry) -> ImageSettings:
    """The run's shared image cache: each fixture task's image is built once."""
    return image_registry.settings(shared_image_cache)


@pytest.fixture
def sandbox_factory(tmp_path: Path, harbor_images: ImageSettings) -> Any:
    return image_factory(tmp_path / "state", harbor_images)


@pytest.mark.timeout(400)  # the module's first test builds its images (loaded machines)
async def test_oracle_earns_1_and_noop_0(tmp_path: Path, sandbox_factory: Any) -> None:
    results = await harbor_import.check(
        [FIXTURES / name for name in ("hello-file", "system-command", "prebuilt-json")],
        sandbox_factory)
    assert [(r.task, r.oracle, r.noop, r.problems) for r in results] == [
        ("hello-file", 1.0, 0.0, ()), ("system-command", 1.0, 0.0, ()),
        ("rollout-tests/prebuilt-json", 1.0, 0.0, ())]


@pytest.mark.timeout(400)  # one more build (useradd) on a loaded machine
async def test_a_task_whose_dockerfile_sets_user_runs_and_is_verified_as_that_user(
        tmp_path: Path, sandbox_factory: Any) -> None:
    # Harbor tasks may end their Dockerfile with USER: the oracle, the no-op and the verifier
    # run as that user (resolved in the image), and the verifier still scores.
    task = tmp_path / "as-user"
    shutil.copytree(FIXTURES / "hello-file", task)
    (task / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nRUN useradd -m -u 1234 agent\nWORKDIR /app\nUSER agent\n")
    (task / "solution" / "solve.sh").write_text(
        '#!/bin/bash\necho "Hello from Harbor!" > greeting.txt\nid -un > whoami.txt\n')
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\n"
        'if [ "$(cat /app/greeting.txt)" = "Hello from Harbor!" ] && '
        '[ "$(cat /app/whoami.txt)" = agent ] && [ "$(id -u)" = 1234 ] && '
        '[ "$HOME" = /home/agent ]; then echo 1 > /logs/verifier/reward.txt; '
        "else echo 0 > /logs/verifier/reward.txt; fi\n")
    results = await harbor_import.check([task], sandbox_factory)
    assert [(r.oracle, r.noop, r.problems) for r in results] == [(1.0, 0.0, ())]


def test_check_harbor_lists_a_task_whose_verifier_fails(
        tmp_path: Path, harbor_images: ImageSettings,
        capsys: pytest.CaptureFixture[str]) -> None:
    # A verifier past its timeout earns the oracle 0: the check lists the task.
    assert tasks_main(["check-harbor", str(FIXTURES / "slow-verifier"), "--state-dir",
                       str(tmp_path / "state"), "--image-cache", harbor_images.cache_dir,
                       "--registries-conf", harbor_images.registries_conf]) == 1
    out, err = capsys.readouterr()
    row = json.loads(out.splitlines()[0])
    assert row["ok"] is False and row["oracle"] == 0.0 and row["noop"] == 0.0
    assert "ran past its 3 s timeout" in row["problems"][0]
    assert "FAILED slow-verifier" in err and "0 of 1 tasks pass" in err


async def test_non_binary_reward_and_named_components(rollout: Rollout) -> None:
    # Two of the three answers right: a third of the reward is lost, each part is named.
    script = [call("bash", command="cd /app && echo 27 > sum.txt && echo 17 > max.txt "
                                   "&& echo 5 > count.txt"), DONE]
    result = await rollout(HarborHandler(), line("partial-credit")["task"], script)
    assert result.reward.value == pytest.approx(0.6667)
    assert result.reward.components == {"reward": 0.6667, "sum": 1.0, "max": 1.0,
                                        "count": 0.0}
    assert result.reward.info["reward_file"] == "reward.json"


async def test_the_test_reads_files_the_agent_put_in_system_paths(rollout: Rollout) -> None:
    install = ("printf '#!/bin/sh\\necho \"$*!\" | tr a-z A-Z\\n' > /usr/local/bin/shout && "
               "chmod +x /usr/local/bin/shout && echo version=1.0 > /etc/shout.conf && "
               "shout it works")
    result = await rollout(HarborHandler(), line("system-command")["task"],
                           [call("bash", command=install), DONE])
    assert "IT WORKS!" in result.prompt_text()
    assert result.reward.value == 1.0, result.reward.info
    # The same commands without the file in /etc: the verifier sees the difference.
    partial = install.replace(" && echo version=1.0 > /etc/shout.conf", "")
    result = await rollout(HarborHandler(), line("system-command")["task"],
                           [call("bash", command=partial), DONE])
    assert result.reward.value == 0.0


async def test_a_hostile_policy_cannot_write_the_reward(rollout: Rollout) -> None:
    # The agent plants a reward, a fake test script, and a process that keeps writing a
    # reward of 1; it never does the task. The tests' folder is empty while it runs.
    plant = ("ls -A /tests | wc -l; mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
             "echo '{\"reward\": 1}' > /logs/verifier/reward.json; "
             "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; "
             "chmod +x /tests/test.sh; "
             "(while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; "
             "done) > /dev/null 2>&1 &")
    result = await rollout(HarborHandler(), line("hello-file")["task"],
                           [call("bash", command=plant), DONE])
    assert "<|im_start|>tool\n0\n" in result.prompt_text()  # /tests had no entry
    assert result.reward.value == 0.0, result.reward.info
    assert result.reward.info["reward_file"] == "reward.txt"
    # Control: the same job doing the task earns 1.
    result = await rollout(HarborHandler(), line("hello-file")["task"],
                           [call("bash", command="echo 'Hello from Harbor!' > greeting.txt"),
                            DONE])
    assert result.reward.value == 1.0, result.reward.info


async def test_a_changed_folder_is_refused(tmp_path: Path, rollout: Rollout) -> None:
    from rollout.runtime.handler import HandlerError

    folder = tmp_path / "hello-file"
    shutil.copytree(FIXTURES / "hello-file", folder)
    task = line("hello-file", folder=tmp_path)["task"]
    (folder / "tests" / "test.sh").write_text("#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n")
    with pytest.raises(HandlerError, match="changed since it was imported"):
        await rollout(HarborHandler(), task, [DONE], limits=Limits(max_turns=1))


async def test_a_harness_runs_a_harbor_task_in_its_image(rollout: Rollout) -> None:
    from rollout.runtime.envs.harness.handler import HarnessHandler
    from tests.runtime.envs.harness_helpers import PingGateway

    # A user's harness (a command; here one that does the task without asking the model), in
    # the task's image and working directory; INIT and the verifier are the harbor
    # environment's own.
    harness = {"command": ["bash", "-c", "pwd > where.txt && cat {prompt_file} > seen.txt && "
                                         "echo 'Hello from Harbor!' > greeting.txt"]}
    task = harness_task("harbor", line("hello-file")["task"], harness)
    result = await rollout(HarnessHandler(), task, [], gateway=PingGateway(),
                           limits=Limits(max_turns=2, run_timeout_s=60))
    assert result.outcome.metadata["harness_exit"] == "0", result.outcome.metadata
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.info["task"] == "hello-file"


def test_import_harbor_prepare_builds_images_and_names_a_broken_task(
        tmp_path: Path, harbor_images: ImageSettings,
        capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken-build"
    shutil.copytree(FIXTURES / "hello-file", broken)
    (broken / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nCOPY not-in-the-context.txt /app/\n")
    args = ["import-harbor", "--prepare", "--image-cache", harbor_images.cache_dir,
            "--registries-conf", harbor_images.registries_conf]
    assert tasks_main([*args, str(FIXTURES / "hello-file")]) == 0
    assert json.loads(capsys.readouterr().out)["task"]["task_dir"].endswith("hello-file")
    assert tasks_main([*args, str(broken)]) == 2
    err = capsys.readouterr().err
    assert "broken-build" in err and "not-in-the-context.txt" in err


async def test_a_task_whose_image_does_not_build_fails_naming_it(tmp_path: Path,
                                                                 rollout: Rollout) -> None:
    from rollout.runtime.sandbox.images import ImageError

    broken = tmp_path / "broken-build"
    shutil.copytree(FIXTURES / "hello-file", broken)
    (broken / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nUSER\n")
    with pytest.raises(ImageError) as err:
        await rollout(HarborHandler(), line("broken-build", folder=tmp_path)["task"], [DONE],
                      limits=Limits(max_turns=1))
    assert err.value.reason == "IMAGE_BUILD_FAILED" and "broken-build" in str(err.value)


async def _mini_swe_agent_earns_1(rollout: Rollout, gateway_rig: Any, task: str,
                                  script: list[str], limits: Limits) -> Any:
    """mini-swe-agent (through the real gateway) on a fixture task; its reward must be 1."""
    from rollout.runtime.envs.harness.handler import HarnessHandler

    need_mini_swe_agent()
    result = await rollout(HarnessHandler(),
                           harness_task("harbor", line(task)["task"], "mini-swe-agent"),
                           script, gateway=gateway_rig.gateway, limits=limits)
    assert result.reward.value == 1.0, (result.reward.info,
                                        result.outcome.metadata["harness_log"])
    return result


async def test_mini_swe_agent_solves_a_harbor_task_in_its_image(
        rollout: Rollout, gateway_rig: Any) -> None:
    script = [action("echo WD=$(pwd) && echo 'Hello from Harbor!' > greeting.txt"), MSWEA_SUBMIT]
    result = await _mini_swe_agent_earns_1(rollout, gateway_rig, "hello-file", script,
                                           Limits(max_turns=6, run_timeout_s=180))
    assert "WD=/app" in result.prompt_text()  # the preset's shell started in the WORKDIR


# -- multi-step tasks ([[steps]], schema 1.1) ------------------------------------------------

MAKE_TOOL = call("bash", command="printf '#!/bin/sh\\nwc -l < \"$1\" | tr -d \" \"\\n' > "
                                 "/app/count.sh && chmod +x /app/count.sh")
LOOK = call("bash", command="echo TESTS=$(ls -A /tests | wc -l) SETUP=$(cat /app/.setup-ran) "
                            "SCRIPT=$(ls /app/setup.sh 2>&1 | grep -c 'No such') "
                            "WORDS=$(wc -l < /app/words.txt)")


async def test_multi_step_oracle_earns_1_and_noop_0(sandbox_factory: Any) -> None:
    # Each step's solve.sh in turn; the no-op fails the first step's min_reward and stops.
    results = await harbor_import.check([FIXTURES / "multi-step"], sandbox_factory)
    assert [(r.oracle, r.noop, r.problems) for r in results] == [(1.0, 0.0, ())]


async def test_multi_step_steps_run_in_order_each_in_a_conversation_of_its_own(
        rollout: Rollout) -> None:
    from rollout.runtime.types import Segment, SegmentReason

    task = line("multi-step")["task"]
    script = [MAKE_TOOL, DONE,  # make-tool
              LOOK, call("bash", command="/app/count.sh /app/words.txt > /app/answer.txt"),
              DONE,  # configure
              call("bash", command="echo 'Run /app/count.sh FILE' > /app/NOTES.md"), DONE]
    result = await rollout(HarborHandler(), task, in_order(script),
                           limits=Limits(max_turns=len(script)))
    assert result.reward.value == 1.0, result.reward.info
    assert result.outcome.segments == [
        Segment(0, SegmentReason.FIRST), Segment(2, SegmentReason.HISTORY_REWRITTEN, parent=0),
        Segment(5, SegmentReason.HISTORY_REWRITTEN, parent=1)]
    # The configure step's agent starts afresh: its own instruction, not make-tool's turns.
    configure = result.prompt_text(2)
    assert "/app/words.txt" in configure and "count.sh\" | tr" not in configure
    assert "Write an executable shell script" not in configure
    # Its workdir/ was uploaded and setup.sh ran there (and removed itself); the tests of the
    # step before were gone again.
    assert "TESTS=0 SETUP=" in result.prompt_text(3) and "SCRIPT=1 WORDS=3" in (
        result.prompt_text(3))
    assert result.reward.components["step:configure"] == 1.0
    assert result.reward.info["steps_verified"] == "3" and "stopped" not in result.reward.info


async def test_multi_step_stops_under_min_reward_and_the_rest_count_0(rollout: Rollout) -> None:
    task = line("multi-step")["task"]
    script = [MAKE_TOOL, DONE, call("bash", command="echo 4 > /app/answer.txt"), DONE,
              call("bash", command="echo never > /app/NOTES.md"), DONE]
    result = await rollout(HarborHandler(), task, in_order(script),
                           limits=Limits(max_turns=len(script)))
    # configure: lines 0 (under its min_reward table), setup 1: 0.5; document never ran.
    assert result.reward.value == pytest.approx(0.5), result.reward.info
    assert result.reward.components["step:document"] == 0.0
    assert result.reward.components["lines"] == 0.0
    assert "lines = 0, under its min_reward 1" in result.reward.info["stopped"]
    assert len(result.engine.requests) == 4  # the document step's agent never ran


async def test_no_agent_process_outlives_its_step(rollout: Rollout) -> None:
    # make-tool's agent leaves a loop that would answer the configure step for it, and plants
    # a reward for the verifier to find: neither counts.
    plant = ("(while true; do [ -f /app/words.txt ] && /app/count.sh /app/words.txt > "
             "/app/answer.txt; echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; "
             "done) > /dev/null 2>&1 &")
    script = [MAKE_TOOL, call("bash", command=plant), DONE, call("bash", command="sleep 1"),
              DONE]
    result = await rollout(HarborHandler(), line("multi-step")["task"], in_order(script),
                           limits=Limits(max_turns=len(script)))
    assert result.reward.components["step:make-tool"] == 1.0
    assert result.reward.components["step:configure"] == 0.5  # setup 1, lines 0
    assert result.reward.components["lines"] == 0.0, result.reward.info


async def test_a_failing_healthcheck_ends_the_task_with_that_step_at_0(
        tmp_path: Path, sandbox_factory: Any) -> None:
    folder = tmp_path / "multi-step"
    shutil.copytree(FIXTURES / "multi-step", folder)
    toml = folder / "task.toml"
    toml.write_text(toml.read_text().replace("test -x /app/count.sh", "test -f /app/never"))
    value, _ = await harbor_import.run_once(line("multi-step", "oracle", folder=tmp_path),
                                            sandbox_factory, "healthcheck-fails")
    assert value == pytest.approx(1 / 3)  # make-tool 1, configure 0, document not run


async def test_a_harness_runs_each_step_with_that_step_s_instruction(rollout: Rollout) -> None:
    from rollout.runtime.envs.harness.handler import HarnessHandler
    from tests.runtime.envs.harness_helpers import PingGateway

    # A command harness started once per step: each part runs only when the prompt it was
    # given is that step's instruction, so 1 means every step got its own.
    parts = ["grep -q 'Write an executable' {prompt_file} && printf '#!/bin/sh\\nwc -l < "
             "\"$1\" | tr -d \" \"\\n' > /app/count.sh && chmod +x /app/count.sh",
             "grep -q words.txt {prompt_file} && /app/count.sh /app/words.txt > /app/answer.txt",
             "grep -q NOTES.md {prompt_file} && echo 'Run /app/count.sh FILE' > /app/NOTES.md"]
    harness = {"command": ["bash", "-c", "; ".join(parts) + "; true"]}
    task = harness_task("harbor", line("multi-step")["task"], harness)
    result = await rollout(HarnessHandler(), task, [], gateway=PingGateway(),
                           limits=Limits(max_turns=2, run_timeout_s=300))
    assert result.reward.value == 1.0, result.reward.info
    assert result.outcome.metadata["steps_run"] == "3"
    assert result.reward.info["steps_verified"] == "3"


async def test_mini_swe_agent_works_through_a_multi_step_task(rollout: Rollout,
                                                              gateway_rig: Any) -> None:
    script = [action("printf '#!/bin/sh\\nwc -l < \"$1\" | tr -d \" \"\\n' > /app/count.sh "
                     "&& chmod +x /app/count.sh"), MSWEA_SUBMIT,
              action("/app/count.sh /app/words.txt > /app/answer.txt"), MSWEA_SUBMIT,
              action("echo 'Run /app/count.sh FILE' > /app/NOTES.md"), MSWEA_SUBMIT]
    result = await _mini_swe_agent_earns_1(rollout, gateway_rig, "multi-step", script,
                                           Limits(max_turns=12, run_timeout_s=600))
    # One chain per step in the one lease: the gateway saw each step's new conversation.
    assert [s.first_turn for s in result.outcome.segments] == [0, 2, 4]
    assert result.outcome.metadata["steps_run"] == "3"


# -- a separate verifier environment (environment_mode = "separate") --------------------------

DO_THE_TASK = call("bash", command="echo 42 > /app/answer.txt && mkdir -p /app/report "
                                   "/logs/artifacts && echo by hand > /app/report/summary.txt "
                                   "&& echo n > /logs/artifacts/notes.txt")
# What a policy can do to the sandbox it works in: none of it may reach a separate verifier.
TAMPER = call("bash", command=(
    "echo mine > /app/scratch.txt; printf '#!/bin/sh\\necho 41\\n' > /usr/local/bin/python3; "
    "chmod +x /usr/local/bin/python3; mkdir -p /tests /logs/verifier; "
    "printf '#!/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; "
    "chmod +x /tests/test.sh; echo 1 > /logs/verifier/reward.txt; "
    "echo '{\"reward\": 1}' > /logs/verifier/reward.json; "
    "cd /.rollout-artifacts && mkdir -p app/report logs/artifacts && echo 42 > app/answer.txt "
    "&& echo x > app/report/summary.txt && echo n > logs/artifacts/notes.txt; cd /app; "
    "(while true; do echo 1 > /logs/verifier/reward.txt 2>/dev/null; sleep 0.05; done) "
    "> /dev/null 2>&1 &"))


@pytest.mark.timeout(600)  # builds the verifier's image when it is the first to ask
async def test_separate_verifier_oracle_earns_1_and_noop_0(sandbox_factory: Any) -> None:
    results = await harbor_import.check([FIXTURES / "separate-verifier"], sandbox_factory)
    assert [(r.oracle, r.noop, r.problems) for r in results] == [(1.0, 0.0, ())]


@pytest.mark.timeout(600)  # builds the verifier's image when it is the first to ask
async def test_a_separate_verifier_sees_only_the_artifacts(rollout: Rollout) -> None:
    task = line("separate-verifier")["task"]
    # The task done, and the sandbox tampered with: the verifier's own image and tests run
    # on the two artifacts alone (no scratch file, its own python3).
    result = await rollout(HarborHandler(), task, [DO_THE_TASK, TAMPER, DONE])
    assert result.reward.value == 1.0, result.reward.info
    assert result.reward.components == {"reward": 1.0, "answer": 1.0, "isolated": 1.0}
    assert result.reward.info["verifier_environment"] == "separate"
    # Tampering alone earns nothing: the planted test, reward and artifact copy are not read.
    result = await rollout(HarborHandler(), task, [TAMPER, DONE])
    assert result.reward.value == 0.0, result.reward.info
    assert result.reward.components["answer"] == 0.0


@pytest.mark.timeout(600)  # builds the verifier's image when it is the first to ask
async def test_an_artifact_that_is_a_link_is_not_followed(rollout: Rollout) -> None:
    link = call("bash", command="echo 42 > /tmp/real && ln -s /tmp/real /app/answer.txt && "
                                "mkdir -p /app/report /logs/artifacts && echo x > "
                                "/app/report/summary.txt && ln -s /etc /app/report/etc && "
                                "echo n > /logs/artifacts/notes.txt")
    result = await rollout(HarborHandler(), line("separate-verifier")["task"], [link, DONE])
    assert result.reward.components["answer"] == 0.0, result.reward.info
    skipped = json.loads(result.reward.info["artifacts"])["skipped"]
    assert sorted(skipped) == ["/app/answer.txt", "/app/report/etc"]


@pytest.mark.timeout(600)  # builds the verifier's image when it is the first to ask
async def test_artifacts_over_the_budget_earn_0_with_the_reason(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.runtime.envs.harbor import handler

    monkeypatch.setattr(handler, "MAX_ARTIFACT_BYTES", 4096)
    big = call("bash", command="echo 42 > /app/answer.txt && mkdir -p /app/report && "
                               "head -c 100000 /dev/zero > /app/report/summary.txt")
    result = await rollout(HarborHandler(), line("separate-verifier")["task"], [big, DONE])
    assert result.reward.value == 0.0
    assert "over the size" in result.reward.info["error"], result.reward.info


@pytest.mark.timeout(600)  # builds the verifier's image (a user of its own) on a loaded machine
async def test_a_multi_step_task_verifies_each_step_in_a_fresh_sandbox(
        tmp_path: Path, sandbox_factory: Any) -> None:
    # Two steps verified in a fresh sandbox each, of an image built from tests/ with a user
    # only it has ([verifier].user: resolved there, not in the agent's image, where INIT
    # would refuse it), handed the declared folder only: the second step sees the first's
    # file through it, never the agent's scratch file.
    folder = tmp_path / "two-separate-steps"
    shutil.copytree(FIXTURES / "hello-file" / "environment", folder / "environment")
    (folder / "task.toml").write_text(
        'schema_version = "1.1"\nartifacts = ["/app/out"]\n[verifier]\n'
        'environment_mode = "separate"\nuser = "checker"\ntimeout_sec = 60\n'
        '[agent]\ntimeout_sec = 60\n[environment]\nbuild_timeout_sec = 1800.0\n'
        'workdir = "/app"\nallow_internet = false\n'
        '[[steps]]\nname = "first"\nmin_reward = 1\n[steps.verifier]\nenv = { WANT = "a" }\n'
        '[[steps]]\nname = "second"\n[steps.verifier]\nenv = { WANT = "ab" }\n')
    tests = folder / "tests"
    tests.mkdir()
    (tests / "Dockerfile").write_text("FROM python:3.11-slim\nRUN useradd -m -u 1234 checker\n"
                                      "COPY . /tests/\n")
    (tests / "test.sh").write_text(
        '#!/bin/sh\nif [ "$(cat /app/out/*.txt | tr -d "\\n")" = "$WANT" ] && '
        '[ ! -e /app/scratch ] && [ "$(id -un)" = checker ]; then echo 1; else echo 0; fi '
        '> /logs/verifier/reward.txt\n')
    (tests / "test.sh").chmod(0o755)
    for name, letter in (("first", "a"), ("second", "b")):
        step = folder / "steps" / name
        (step / "solution").mkdir(parents=True)
        (step / "instruction.md").write_text(f"Write {name}'s file into /app/out.\n")
        (step / "solution" / "solve.sh").write_text(
            f"mkdir -p /app/out && echo {letter} > /app/out/{letter}.txt && echo x > "
            "/app/scratch\n")
    results = await harbor_import.check([folder], sandbox_factory)
    assert [(r.oracle, r.noop, r.problems) for r in results] == [(1.0, 0.0, ())]


# -- the verifier's network (sandbox.verifier_hosts) ------------------------------------------

NET_SOLVE = """\
#!/bin/bash
# The agent's turn: it tries the proxy's port and the allowed host directly; neither exists.
python3 - <<'PY'
import json, socket, urllib.request
seen = {}
try:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler(
        {"http": "http://127.0.0.1:3128"}))
    opener.open("http://%(addr)s:%(allowed)d/f", timeout=5).read()
    seen["proxy"] = "reached"
except Exception:
    seen["proxy"] = "failed"
try:
    socket.create_connection(("%(addr)s", %(allowed)d), timeout=5).close()
    seen["direct"] = "reached"
except OSError:
    seen["direct"] = "failed"
json.dump(seen, open("/tmp/agent.json", "w"))
PY
"""

NET_TEST = """\
#!/bin/bash
python3 - <<'PY'
import http.client, json, os, socket, urllib.error, urllib.request
addr, allowed, other = "%(addr)s", %(allowed)d, %(other)d
def fetch(port):
    try:
        return urllib.request.urlopen(f"http://{addr}:{port}/f", timeout=10).read().decode()
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code} {e.read().decode().strip()}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
def tunnel():  # CONNECT, as HTTPS goes through a proxy (the byte stream is the server's)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", 3128, timeout=10)
        conn.set_tunnel(addr, allowed)
        conn.request("GET", "/t")
        return conn.getresponse().read().decode()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
try:
    socket.create_connection((addr, allowed), timeout=5).close()
    direct = "reached"
except OSError:
    direct = "failed"
try:
    agent = json.load(open("/tmp/agent.json"))
except OSError:
    agent = {}
got = {"allowed": fetch(allowed), "other": fetch(other), "tunnel": tunnel()}
print("PROBE", json.dumps(got), "closed:", fetch(%(closed)d), flush=True)
parts = {
    "allowed": got["allowed"] == f"served by {allowed}",
    "tunnel": got["tunnel"] == f"served by {allowed}",
    "other_refused": got["other"].startswith("HTTP 403") and f"{addr}:{other}" in got["other"],
    "direct_blocked": direct == "failed",
    "agent_offline": agent == {"proxy": "failed", "direct": "failed"},
    "proxy_env": os.environ.get("HTTPS_PROXY") == "http://127.0.0.1:3128",
}
json.dump({"reward": float(all(parts.values())), **{k: float(v) for k, v in parts.items()}},
          open("/logs/verifier/reward.json", "w"))
PY
"""


def _network_task(root: Path, mirrors: tuple[str, int, int], network: str = "", *,
                  closed: int | None = None) -> Path:
    """The prebuilt-json task (no build) with a solution and a test that probe the network."""
    addr, allowed, other = mirrors
    task = root / "net-probe"
    shutil.copytree(FIXTURES / "prebuilt-json", task)
    toml = (task / "task.toml").read_text().replace('network_mode = "no-network"\n', network)
    (task / "task.toml").write_text(toml.replace("prebuilt-json", "net-probe"))
    values = {"addr": addr, "allowed": allowed, "other": other,
              "closed": closed or _closed_port(addr)}
    (task / "solution" / "solve.sh").write_text(NET_SOLVE % values)
    (task / "tests" / "test.sh").write_text(NET_TEST % values)
    return task


def _closed_port(addr: str) -> int:
    """A port of ``addr`` nothing listens on (a listed host that is down)."""
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


async def _judge(task: Path, factory: Any, agent: str = "oracle") -> Any:
    from rollout.runtime.envs.harbor import taskdir
    from rollout.runtime.handler import JobContext
    from rollout.runtime.types import JobSpec

    job = harbor_import.job_line(taskdir.load(task), agent=agent)
    ctx = JobContext(spec=JobSpec(job_id=f"net-{agent}", environment="harbor",
                                  task=dict(job["task"]), limits=harbor_import.limits_value(job)),
                     sandbox_factory=factory)
    handler = HarborHandler()
    async with ctx.resources:
        await handler.init(ctx)
        ctx.outcome = await handler.run(ctx)
        return await handler.eval(ctx)


def _hosts_factory(state: Path, settings: ImageSettings, hosts: tuple[str, ...]) -> Any:
    import functools

    from rollout.runtime.sandbox.base import SandboxConfig, create_sandbox

    return functools.partial(create_sandbox, SandboxConfig(state_dir=state, images=settings,
                                                           verifier_hosts=hosts))


async def test_the_verifier_reaches_the_allowed_hosts_and_the_agent_nothing(
        tmp_path: Path, harbor_images: ImageSettings,
        mirrors: tuple[str, int, int]) -> None:
    # Listed: plain HTTP and a CONNECT tunnel to it pass the proxy; another host gets a 403
    # naming it; a socket of the test's own reaches nothing; the agent (here the oracle's
    # solve.sh) had neither the proxy nor a route while it ran.
    # A listed host that is down is named with why.
    addr, allowed, other = mirrors
    closed = _closed_port(addr)
    task = _network_task(tmp_path, mirrors, closed=closed)
    factory = _hosts_factory(tmp_path / "state", harbor_images,
                             (f"{addr}:{allowed}", f"{addr}:{closed}"))
    reward = await _judge(task, factory)
    assert reward.components == {"reward": 1.0, "allowed": 1.0, "tunnel": 1.0,
                                 "other_refused": 1.0, "direct_blocked": 1.0,
                                 "agent_offline": 1.0, "proxy_env": 1.0}, reward.info
    assert reward.info["network_refused"] == f"{addr}:{other}"
    assert reward.info["network_failed"].startswith(f"{addr}:{closed}: "), reward.info
    assert f"closed: HTTP 502 rollout verifier network: {addr}:{closed}" in reward.info["log"]


async def test_without_listed_hosts_the_verifier_is_told_what_it_tried(
        tmp_path: Path, harbor_images: ImageSettings,
        mirrors: tuple[str, int, int]) -> None:
    # The default (no hosts): every request is refused, and the check names the hosts to list.
    addr, allowed, other = mirrors
    task = _network_task(tmp_path, mirrors)
    factory = _hosts_factory(tmp_path / "state", harbor_images, ())
    reward = await _judge(task, factory)
    assert reward.components["allowed"] == 0.0 and reward.components["other_refused"] == 1.0
    assert reward.components["direct_blocked"] == 1.0, reward.info
    assert reward.info["network_refused"].startswith(f"{addr}:{allowed}, {addr}:{other}, ")
    assert "network_failed" not in reward.info
    results = await harbor_import.check([task], factory)
    assert results[0].oracle == 0.0
    assert (f"the verifier's network refused {addr}:{allowed}, {addr}:{other}"
            in results[0].problems[0]), results[0].problems
    assert "sandbox.verifier_hosts" in results[0].problems[0]


async def test_a_task_without_internet_gets_no_verifier_network(
        tmp_path: Path, harbor_images: ImageSettings,
        mirrors: tuple[str, int, int]) -> None:
    # allow_internet = false (Harbor's own switch) wins over the server's list: no proxy.
    addr, allowed, _ = mirrors
    task = _network_task(tmp_path, mirrors, "allow_internet = false\n")
    factory = _hosts_factory(tmp_path / "state", harbor_images, (f"{addr}:{allowed}",))
    reward = await _judge(task, factory)
    assert reward.components["allowed"] == 0.0 and reward.components["proxy_env"] == 0.0
    assert reward.components["direct_blocked"] == 1.0, reward.info
    assert "network_refused" not in reward.info
