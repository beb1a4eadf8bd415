"""Harbor task folders read as the `harbor` environment runs them, the reward files as Harbor
reads them, and `rollout tasks import-harbor` (no sandbox needed here)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from rollout.runtime.envs.harbor import taskdir, verdict
from rollout.runtime.envs.harbor.handler import HarborHandler, image_source, sandbox_limits
from rollout.runtime.envs.harbor.taskdir import TaskFolderError
from rollout.runtime.tasksets import harbor_import
from rollout.runtime.tasksets.shipped import main as tasks_main
from rollout.runtime.types import InvalidArgument

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "harbor"


def copy_task(tmp_path: Path, name: str = "hello-file") -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest)
    return dest


def test_fixture_tasks_load_with_their_settings() -> None:
    hello = taskdir.load(FIXTURES / "hello-file")
    assert hello.name == "hello-file" and hello.instruction.startswith("Create a file")
    assert (hello.agent_timeout_s, hello.verifier_timeout_s, hello.build_timeout_s) == (
        120.0, 60.0, 1800.0)
    assert hello.has_dockerfile and not hello.docker_image and not hello.allow_internet
    assert hello.has_solution and hello.storage_mb == 1024
    prebuilt = taskdir.load(FIXTURES / "prebuilt-json")
    # The later 1.x spellings: memory/storage as sizes, network_mode, [task].name.
    assert prebuilt.name == "rollout-tests/prebuilt-json"
    assert (prebuilt.memory_mb, prebuilt.storage_mb) == (2048, 1024)
    assert prebuilt.allow_internet is False and prebuilt.docker_image == "python:3.11-slim"
    assert prebuilt.verifier_env == {"EXPECTED_ITEMS": "3"}
    assert image_source(prebuilt) == "docker://python:3.11-slim"
    assert taskdir.load(FIXTURES / "hello-file").unknown_keys == ()


def test_limits_follow_task_toml() -> None:
    hello = taskdir.load(FIXTURES / "hello-file")
    limits = sandbox_limits(hello)
    assert limits.address_space_bytes == 2048 << 20
    assert limits.file_size_bytes == 1024 << 20
    assert limits.cpu_seconds == 120 + 60


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "task.toml").write_text('version = "2.0"\n'), "schema 1.x"),
    (lambda d: (d / "task.toml").write_text("[environment]\ngpus = 1\n"), "no GPU"),
    (lambda d: (d / "task.toml").write_text('[environment]\nos = "windows"\n'), "only linux"),
    (lambda d: (d / "task.toml").write_text('[environment]\nmemory = "lots"\n'), "memory"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = -1\n"), "timeout_sec"),
    (lambda d: (d / "task.toml").write_text("[verifier\n"), "not valid TOML"),
    (lambda d: (d / "task.toml").write_text("x = " + "[" * 20000 + "]" * 20000 + "\n"),
     "task.toml: nested too deeply"),
    (lambda d: (d / "tests" / "test.sh").unlink(), "tests/test.sh"),
    (lambda d: (d / "instruction.md").write_text("  \n"), "empty"),
    (lambda d: shutil.rmtree(d / "environment"), "no image"),
    # Multi-container tasks (Harbor's own cloud providers refuse them too).
    (lambda d: (d / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    depends_on: [tools]\n  tools:\n    build: ./tools\n"),
     "docker-compose.yaml: a multi-container task \\(services tools beside"),
    (lambda d: (d / "environment" / "compose.yml").write_text(
        "services:\n  db: {image: postgres}\n  cache: {image: redis}\n"),
     "compose.yml: a multi-container task \\(services cache, db beside"),
    (lambda d: (d / "environment" / "compose.yaml").write_text("services: [\n"),
     "compose.yaml: not valid YAML"),
    (lambda d: (d / "environment" / "compose.yaml").write_text(
        "services: " + "[" * 20000 + "]" * 20000 + "\n"), "compose.yaml: nested too deeply"),
    (lambda d: (d / "task.toml").write_text(
        '[[environment.mcp_servers]]\nname = "tools"\ntransport = "streamable-http"\n'
        'url = "http://tools:8000/mcp"\n'), "mcp_servers"),
    # Harbor's separate verifier environment needs an image (tests/Dockerfile or its own).
    (lambda d: (d / "task.toml").write_text('[verifier]\nenvironment_mode = "separate"\n'),
     "a separate verifier needs its image"),
    (lambda d: (d / "task.toml").write_text('[verifier.environment]\ncpus = 2\n'),
     "a separate verifier needs its image"),
    (lambda d: (d / "task.toml").write_text('[verifier.environment]\ngpus = 1\n'),
     "verifier.environment\\] gpus = 1"),
    (lambda d: (d / "task.toml").write_text(
        '[verifier]\nenvironment_mode = "shared"\n[verifier.environment]\ncpus = 2\n'),
     "shared\" with a \\[verifier.environment\\]"),
    (lambda d: (d / "task.toml").write_text('[verifier]\nenvironment_mode = "both"\n'),
     "environment_mode must be"),
    (lambda d: (d / "task.toml").write_text('[[verifier.collect]]\ncommand = "dump-state"\n'),
     "\\[verifier\\] collect: \\[\\[verifier.collect\\]\\] hooks"),
    # A multi-step task (schema 1.1) names a step whose folder is missing.
    (lambda d: ((d / "instruction.md").unlink(), (d / "task.toml").write_text(
        'schema_version = "1.1"\n[environment]\nmcp_servers = []\n'
        '[[steps]]\nname = "scaffold"\nmin_reward = 1.0\n')),
     "no steps/ folder"),
])
def test_unusable_folders_are_refused_naming_what_to_fix(tmp_path: Path, edit, message) -> None:
    folder = copy_task(tmp_path)
    edit(folder)
    with pytest.raises(TaskFolderError, match=message):
        taskdir.load(folder)


def test_unknown_keys_are_listed_not_refused(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    # An empty mcp_servers (as Harbor's own examples write it) is not a multi-container task.
    text = (folder / "task.toml").read_text().replace("[environment]\n",
                                                      "[environment]\nmcp_servers = []\n")
    (folder / "task.toml").write_text(text)
    with (folder / "task.toml").open("a") as f:
        f.write("\n[environment.extra]\nx = 1\n[telemetry]\non = true\n")
    text = (folder / "task.toml").read_text().replace("[environment]\n",
                                                      "[environment]\nfancy = 1\n")
    (folder / "task.toml").write_text(text)
    assert set(taskdir.load(folder).unknown_keys) >= {"telemetry", "environment.fancy"}
    # A Compose overlay that only adjusts the agent's container is a single-container task;
    # what it sets is not applied here, and reported.
    (folder / "environment" / "docker-compose.yaml").write_text(
        "services:\n  main:\n    shm_size: 2gb\n    environment: [X=1]\n"
        "x-note: {a: 1}\n")
    assert set(taskdir.load(folder).unknown_keys) >= {
        "environment/docker-compose.yaml: services.main.shm_size",
        "environment/docker-compose.yaml: services.main.environment",
        "environment/docker-compose.yaml: x-note"}


def test_a_compose_alias_bomb_is_read_without_expanding_it(tmp_path: Path) -> None:
    """Nine levels of ten aliases (a billion leaves if expanded) in 500 bytes: the YAML
    reader shares what an alias names and the loader reads only ``services``' names and
    ``main``'s keys, so the folder loads at once and reports nothing it did not find."""
    folder = copy_task(tmp_path)
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    (folder / "environment" / "docker-compose.yaml").write_text(
        "\n".join([*lines, "services: {main: *a8}", ""]))
    assert set(taskdir.load(folder).unknown_keys) == {
        f"environment/docker-compose.yaml: a{i}" for i in range(9)}


def test_validate_task_names_the_field(tmp_path: Path) -> None:
    handler = HarborHandler()
    handler.validate_task({"task_dir": str(FIXTURES / "hello-file"), "agent": "oracle"})
    with pytest.raises(InvalidArgument) as err:
        handler.validate_task({"task_dir": str(tmp_path)})
    assert err.value.field == "task.task_dir" and "task.toml" in str(err.value)
    with pytest.raises(InvalidArgument) as err:
        handler.validate_task({"task_dir": str(FIXTURES / "hello-file"), "agent": "human"})
    assert err.value.field == "task.agent"
    with pytest.raises(InvalidArgument, match="unknown fields"):
        handler.validate_task({"task_dir": str(FIXTURES / "hello-file"), "image": "x"})


@pytest.mark.parametrize(("files", "value", "components", "problem"), [
    ({"reward.txt": b"1\n"}, 1.0, {"reward": 1.0}, ""),
    ({"reward.txt": b"0.25"}, 0.25, {"reward": 0.25}, ""),
    # reward.json wins over reward.txt, as in Harbor; every entry is a component.
    ({"reward.txt": b"0", "reward.json": b'{"reward": 0.5, "style": 1}'}, 0.5,
     {"reward": 0.5, "style": 1.0}, ""),
    ({"reward.json": b'{"accuracy": 0.75, "speed": 0.1}'}, 0.75,
     {"accuracy": 0.75, "speed": 0.1}, ""),
    ({}, 0.0, {}, "neither"),
    ({"reward.txt": b""}, 0.0, {}, "empty"),
    ({"reward.txt": b"yes"}, 0.0, {}, "not a number"),
    ({"reward.txt": b"nan"}, 0.0, {}, "not finite"),
    ({"reward.json": b"[1]"}, 0.0, {}, "non-empty object"),
    ({"reward.json": b'{"reward": "1"}'}, 0.0, {}, "not a finite number"),
    ({"reward.json": b'{"reward": true}'}, 0.0, {}, "not a finite number"),
    ({"reward.json": b"{"}, 0.0, {}, "not JSON"),
    # Nested past the parser's limit (the agent can make the verifier write anything): a 0
    # with the reason, not a failed EVAL that would keep the rollout out of training.
    ({"reward.json": b'{"r": ' + b"[" * 3000 + b"]" * 3000 + b"}"}, 0.0, {}, "too deeply"),
])
def test_reward_files(files, value, components, problem) -> None:
    found = verdict.read({"reward.json": files.get("reward.json"),
                          "reward.txt": files.get("reward.txt")})
    assert found.value == value
    assert found.components == components
    assert problem in found.problem and bool(problem) == bool(found.problem)


def test_import_harbor_writes_job_lines_for_a_dataset(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert tasks_main(["import-harbor", str(FIXTURES), "--job-id-prefix", "r1-",
                       "--samples", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    names = sorted(p.name for p in FIXTURES.iterdir() if (p / "task.toml").is_file())
    assert len(lines) == 2 * len(names)
    by_dir = {Path(line["task"]["task_dir"]).name: line for line in lines}
    assert sorted(by_dir) == names
    hello = by_dir["hello-file"]
    assert hello["environment"] == "harbor"
    assert hello["limits"] == {"initTimeout": "1920s", "runTimeout": "125s",
                               "evalTimeout": "180s"}
    limits = harbor_import.limits_value(hello)
    assert (limits.init_timeout_s, limits.run_timeout_s, limits.eval_timeout_s) == (
        1800.0 + harbor_import.SETUP_MARGIN_S, 125.0, 60.0 + harbor_import.SETUP_MARGIN_S)
    assert hello["task"]["digest"] == taskdir.digest(FIXTURES / "hello-file")
    assert {line["job_id"] for line in lines} >= {"r1-hello-file-0", "r1-hello-file-1"}
    # A prebuilt image's fetch is set-up too: INIT gets the task's build timeout (its default
    # here) for it, not the margin alone (a multi-gigabyte image does not come in 120 s).
    prebuilt = by_dir["prebuilt-json"]
    assert prebuilt["limits"]["initTimeout"] == (
        f"{taskdir.DEFAULT_TIMEOUT_S + harbor_import.SETUP_MARGIN_S:g}s")
    assert prebuilt["job_id"].startswith("r1-rollout-tests__prebuilt-json-")


def test_import_harbor_refuses_a_broken_task(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    folder = copy_task(tmp_path)
    (folder / "tests" / "test.sh").unlink()
    assert tasks_main(["import-harbor", str(tmp_path)]) == 2
    assert "tests/test.sh" in capsys.readouterr().err


def test_oversized_tests_are_refused_off_the_submit_path(tmp_path: Path) -> None:
    folder = copy_task(tmp_path)
    with (folder / "tests" / "data.bin").open("wb") as f:  # sparse: no disk used
        f.truncate(taskdir.MAX_FOLDER_BYTES + 1)
    taskdir.load(folder, sizes=False)  # what a submit checks: the small files
    with pytest.raises(TaskFolderError, match="over the"):
        taskdir.load(folder)


def _steps_task(tmp_path: Path, steps_toml: str, top: str = "") -> Path:
    """The multi-step fixture with its [[steps]] tables replaced."""
    folder = copy_task(tmp_path, "multi-step")
    text = (folder / "task.toml").read_text()
    head = text[:text.index("[[steps]]")].replace('multi_step_reward_strategy = "mean"\n', "")
    (folder / "task.toml").write_text(top + head + steps_toml)
    return folder


@pytest.mark.parametrize(("steps_toml", "top", "message"), [
    ("", "steps = 3\n", "must be one or more tables"),
    ('[[steps]]\nname = "make-tool"\n[[steps.verifier.collect]]\ncommand = "x"\n', "",
     "#1 \\[steps.verifier\\] collect: \\[\\[verifier.collect\\]\\] hooks"),
    ('[[steps]]\nname = "make-tool"\n[steps.verifier]\nenvironment_mode = "separate"\n', "",
     "'make-tool' \\[steps.verifier\\]: a separate verifier needs its image"),
    ('[[steps]]\nname = "../up"\n', "", "name must be a folder name"),
    ('[[steps]]\nname = "make-tool"\n[[steps]]\nname = "make-tool"\n', "",
     "two steps are named 'make-tool'"),
    ('[[steps]]\nname = "nowhere"\n', "", "no folder steps/nowhere/"),
    ('[[steps]]\nname = "make-tool"\nmin_reward = "high"\n', "", "min_reward must be"),
    ('[[steps]]\nname = "make-tool"\nmin_reward = {reward = "x"}\n', "",
     "min_reward reward must be a finite number"),
    ('[[steps]]\nname = "make-tool"\n[steps.healthcheck]\ninterval_sec = 1\n', "",
     "command must be a shell command"),
    ('[[steps]]\nname = "make-tool"\n[steps.healthcheck]\ncommand = "true"\nretries = 0\n',
     "", "retries must be a whole number from 1 to 100"),
    ('[[steps]]\nname = "make-tool"\n[steps.agent]\nuser = "nobody"\n', "",
     "user = 'nobody': every step's agent runs as the task's \\[agent\\].user"),
    ('[[steps]]\nname = "make-tool"\n[steps.agent]\ntimeout_sec = 0\n', "",
     "timeout_sec must be a positive number"),
    ('[[steps]]\nname = "make-tool"\n', 'multi_step_reward_strategy = "max"\n',
     "multi_step_reward_strategy must be one of 'mean', 'final'"),
    ("".join(f'[[steps]]\nname = "make-tool-{i}"\n' for i in range(65)), "",
     "65 steps, over the 64"),
])
def test_bad_steps_are_refused_naming_what_to_fix(tmp_path: Path, steps_toml: str, top: str,
                                                  message: str) -> None:
    folder = _steps_task(tmp_path, steps_toml, top)
    with pytest.raises(TaskFolderError, match=message):
        taskdir.load(folder)


def test_a_step_without_a_verifier_is_refused(tmp_path: Path) -> None:
    # The document step verifies with the task's tests/test.sh; without it, it has none.
    folder = copy_task(tmp_path, "multi-step")
    (folder / "tests" / "test.sh").unlink()
    with pytest.raises(TaskFolderError, match="'document': no verifier"):
        taskdir.load(folder)


@pytest.mark.parametrize("link", ["steps", "steps/configure/workdir", "steps/configure/tests",
                                  "steps/make-tool/solution"])
def test_a_step_folder_that_is_a_link_is_refused(tmp_path: Path, link: str) -> None:
    # A task's links could copy host files into a job's sandbox (a step's workdir/ goes to
    # the agent): its step folders must be its own.
    folder = copy_task(tmp_path, "multi-step")
    target = folder / link
    shutil.move(target, tmp_path / "elsewhere")
    target.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TaskFolderError, match="link"):
        taskdir.load(folder)


def test_the_multi_step_fixture_loads_its_steps() -> None:
    task = taskdir.load(FIXTURES / "multi-step")
    assert [s.name for s in task.steps] == ["make-tool", "configure", "document"]
    assert task.instruction == task.steps[0].instruction and task.reward_strategy == "mean"
    first, second, third = task.steps
    assert first.min_reward == 1.0 and first.verifier_timeout_s == 30.0
    assert first.agent_timeout_s == 120.0  # the task's [agent] where the step sets none
    assert second.min_reward == {"lines": 1.0} and second.agent_timeout_s == 90.0
    # The step's verifier env over the task's.
    assert second.verifier_env == {"SHARED_SETTING": "from-the-task", "EXPECTED_LINES": "3"}
    assert second.has_workdir and second.has_tests and not third.has_tests
    assert second.healthcheck is not None and second.healthcheck.retries == 2
    assert task.has_solution and task.unknown_keys == ()
    # RUN holds every agent and every verifier but the last one (EVAL's).
    limits = harbor_import.limits_of(task)
    assert float(limits["runTimeout"].rstrip("s")) > 120 + 90 + 120 + 30 + 60
    assert limits["evalTimeout"] == f"{60 + harbor_import.SETUP_MARGIN_S:g}s"


def test_below_minimum_reads_the_reward_or_the_named_entries() -> None:
    _, second, third = taskdir.load(FIXTURES / "multi-step").steps
    assert second.below_minimum({"reward": 0.5, "lines": 1.0}) == ""
    assert "lines = 0, under its min_reward 1" in second.below_minimum({"reward": 1.0})
    assert third.below_minimum({"reward": 0.0}) == ""  # no min_reward: never stops


def test_roll_up_counts_steps_that_did_not_run() -> None:
    from rollout.runtime.envs.harbor.handler import StepResult, roll_up

    task = taskdir.load(FIXTURES / "multi-step")
    done = [StepResult("make-tool", 1.0, {"reward": 1.0}),
            StepResult("configure", 0.5, {"reward": 0.5, "lines": 0.0, "setup": 1.0},
                       stop="under its min_reward")]
    reward = roll_up(task, done)
    # Three steps, the third not run: it counts 0, so failing a step early never pays more.
    assert reward.value == pytest.approx(0.5)
    assert reward.components == pytest.approx({
        "reward": 0.5, "lines": 0.0, "setup": 1 / 3, "step:make-tool": 1.0,
        "step:configure": 0.5, "step:document": 0.0})
    assert reward.info["stopped"] == "under its min_reward"
    assert json.loads(reward.info["step_results"])[1]["reward"] == 0.5
    final = roll_up(dataclasses.replace(task, reward_strategy="final"), done)
    assert final.value == 0.0 and final.components["step:configure"] == 0.5
    finished = [*done[:1], StepResult("configure", 1.0, {"reward": 1.0}),
                StepResult("document", 0.25, {"reward": 0.25, "style": 1.0})]
    final = roll_up(dataclasses.replace(task, reward_strategy="final"), finished)
    assert (final.value, final.components["style"]) == (0.25, 1.0)
    assert roll_up(task, finished).value == pytest.approx(0.75)


def test_a_separate_verifier_is_read_with_its_artifacts(tmp_path: Path) -> None:
    task = taskdir.load(FIXTURES / "separate-verifier")
    assert task.separate is not None and task.separate.context == "tests"
    assert task.artifacts == ("/app/answer.txt", "/app/report") and task.unknown_keys == ()
    assert task.separate.memory_mb == task.memory_mb  # the task's [environment] by default
    # A prebuilt verifier image instead of tests/Dockerfile, with resources of its own.
    folder = copy_task(tmp_path, "separate-verifier")
    (folder / "tests" / "Dockerfile").unlink()
    text = (folder / "task.toml").read_text().replace(
        '[environment]\n', '[verifier.environment]\ndocker_image = "python:3.12-slim"\n'
        'cpus = 2\nmcp = 1\n\n[environment]\n')
    (folder / "task.toml").write_text(text)
    task = taskdir.load(folder)
    assert task.separate is not None and task.separate.docker_image == "python:3.12-slim"
    assert (task.separate.context, task.separate.cpus) == ("", 2.0)
    assert task.unknown_keys == ("verifier.environment.mcp",)
    # Its network switch: the task's (allow_internet = false here) unless it sets its own.
    assert (task.allow_internet, task.separate.allow_internet) == (False, False)
    (folder / "task.toml").write_text(
        text.replace("cpus = 2\n", 'cpus = 2\nnetwork_mode = "public"\n', 1))
    task = taskdir.load(folder)
    assert task.separate is not None and task.separate.allow_internet
    assert not task.allow_internet
    # Artifacts without a separate verifier are listed as not collected.
    hello = copy_task(tmp_path, "hello-file")
    (hello / "task.toml").write_text('artifacts = ["/app/out.txt"]\n'
                                     + (hello / "task.toml").read_text())
    assert taskdir.load(hello).unknown_keys == (
        "artifacts (collected for a separate verifier only)",)


@pytest.mark.parametrize(("artifacts", "message"), [
    ('["app/x"]', "each entry must be an absolute path"),
    ('["/"]', "each entry must be an absolute path"),
    ('[3]', "each entry must be an absolute path"),
    ('[{ source = "/var/log/x", service = "api" }]', "service 'api', a sidecar"),
    ('["/tests/test.sh"]', "'/tests/test.sh' is or holds /tests"),
    ('["/logs"]', "'/logs' is or holds /logs/verifier"),
    ('"/app/x"', "must be a list"),
])
def test_bad_artifacts_are_refused(tmp_path: Path, artifacts: str, message: str) -> None:
    folder = copy_task(tmp_path, "separate-verifier")
    text = (folder / "task.toml").read_text().replace(
        'artifacts = ["/app/answer.txt", { source = "/app/report", destination = "report" }]',
        f"artifacts = {artifacts}")
    (folder / "task.toml").write_text(text)
    with pytest.raises(TaskFolderError, match=message):
        taskdir.load(folder)


def test_steps_take_the_task_s_verifier_mode_or_their_own(tmp_path: Path) -> None:
    folder = copy_task(tmp_path, "multi-step")
    (folder / "tests" / "Dockerfile").write_text("FROM python:3.11-slim\nCOPY . /tests/\n")
    own = folder / "steps" / "configure" / "tests" / "Dockerfile"
    own.write_text("FROM python:3.11-slim\nCOPY . /tests/\n")
    text = (folder / "task.toml").read_text()
    text = text.replace('[verifier]\n', '[verifier]\nenvironment_mode = "separate"\n', 1)
    text = text.replace('[steps.verifier]\ntimeout_sec = 30.0\n',
                        '[steps.verifier]\ntimeout_sec = 30.0\n', 1)
    text += '\n[steps.verifier]\nenvironment_mode = "shared"\n'  # the last step: shared
    text = text.replace('[[steps]]\nname = "document"\n',
                        '[[steps]]\nname = "document"\nartifacts = ["/app/NOTES.md"]\n')
    (folder / "task.toml").write_text('artifacts = ["/app/count.sh"]\n' + text)
    task = taskdir.load(folder)
    make_tool, configure, document = task.steps
    assert make_tool.separate is not None and make_tool.separate.context == "tests"
    assert configure.separate is not None
    assert configure.separate.context == "steps/configure/tests"
    assert document.separate is None
    assert document.artifacts == ("/app/count.sh", "/app/NOTES.md")
    assert len(task.verifier_environments) == 2


def test_prepare_builds_a_separate_verifier_s_image_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout.runtime.sandbox.images import prepare

    asked: list[object] = []
    monkeypatch.setattr(prepare, "prepare_images",
                        lambda sources, settings: asked.extend(sources) or [])
    line = harbor_import.job_line(taskdir.load(FIXTURES / "separate-verifier"))
    assert harbor_import.prepare_images([line, line]) == []
    contexts = sorted(str(getattr(s, "context", s)) for s in asked)
    assert contexts == [str(FIXTURES / "separate-verifier" / "environment"),
                        str(FIXTURES / "separate-verifier" / "tests")]
    # INIT has the time to build both.
    init = float(harbor_import.limits_of(taskdir.load(FIXTURES / "separate-verifier"))[
        "initTimeout"].rstrip("s"))
    assert init == 1800 + 1800 + harbor_import.SETUP_MARGIN_S
