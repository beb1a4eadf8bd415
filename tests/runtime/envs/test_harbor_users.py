"""Harbor's ``[agent].user`` and ``[verifier].user`` apply, as Harbor's own exec applies them:
the agent's commands (here the oracle's ``solve.sh``) run as ``[agent].user`` and
``tests/test.sh`` as ``[verifier].user``, each unset meaning the image's ``USER``; a user the
image lacks fails INIT naming the task and the key. Tasks on the fixtures' busybox image with
an ``app`` user (uid 1000, home ``/home/app``), tagged by the ``USER`` its config names."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.harbor import taskdir
from rollout.runtime.envs.harbor.taskdir import TaskFolderError
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.tasksets import harbor_import
from tests.runtime.envs.harbor_helpers import image_factory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# solve.sh leaves who ran it; test.sh scores 1 only when the agent and the verifier each ran
# as the user the test expects ("root": the image's root, whose uid a root server maps onto
# the sandbox's own, so it is told by its HOME and by not being app).
SOLVE = '#!/bin/sh\necho "$(id -u) $HOME" > /tmp/agent-id\n'
TEST = """#!/bin/sh
is() {
  if [ "$2" = root ]; then [ "${1#* }" = /tmp/home ] && [ "${1%% *}" != 1000 ]
  else [ "$1" = "$2" ]; fi
}
agent=$(cat /tmp/agent-id 2>/dev/null)
me="$(id -u) $HOME"
echo "agent: $agent; verifier: $me"
if is "$agent" "$WANT_AGENT" && is "$me" "$WANT_VERIFIER"; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""
APP = "1000 /home/app"


def _task(top: Path, name: str, layout: Path, tag: str, want_agent: str, want_verifier: str,
          users: str = "") -> Path:
    folder = top / name
    for sub in ("solution", "tests"):
        (folder / sub).mkdir(parents=True)
    (folder / "instruction.md").write_text("Leave who you are in /tmp/agent-id.\n")
    (folder / "solution" / "solve.sh").write_text(SOLVE)
    (folder / "tests" / "test.sh").write_text(TEST)
    agent, _, verifier = users.partition("|")
    (folder / "task.toml").write_text(
        'version = "1.0"\n'
        f"[agent]\ntimeout_sec = 60.0\n{agent}\n"
        f"[verifier]\ntimeout_sec = 60.0\n{verifier}\n"
        f'env = {{ WANT_AGENT = "{want_agent}", WANT_VERIFIER = "{want_verifier}" }}\n'
        f'[environment]\ndocker_image = "oci:{layout}:{tag}"\n')
    return folder


@pytest.fixture
def factory(tmp_path: Path) -> Any:
    return image_factory(tmp_path / "state", ImageSettings(cache_dir=str(tmp_path / "cache")))


async def test_agent_and_verifier_users_apply(tmp_path: Path, user_layout: Path,
                                              factory: Any) -> None:
    tasks = tmp_path / "tasks"
    # An image whose USER is root; the task runs its agent as app, its verifier as the image's.
    _task(tasks, "a-agent-user", user_layout, "root", APP, "root", 'user = "app"|')
    # An image whose USER is app; the task runs its verifier as root.
    _task(tasks, "b-verifier-root", user_layout, "named", APP, "root", '|user = "root"')
    # A uid (a TOML integer) for the agent, a name for the verifier, on a root image.
    _task(tasks, "c-both", user_layout, "root", APP, APP, 'user = 1000|user = "app"')
    # Neither set: the image's USER for both (the control).
    _task(tasks, "d-image-user", user_layout, "named", APP, APP)
    results = await harbor_import.check([tasks], factory)
    assert [(r.task, r.oracle, r.noop, r.problems) for r in results] == [
        (name, 1.0, 0.0, ()) for name in ("a-agent-user", "b-verifier-root", "c-both",
                                          "d-image-user")]


async def test_a_user_the_image_lacks_fails_naming_the_task_and_the_key(
        tmp_path: Path, user_layout: Path, factory: Any) -> None:
    tasks = tmp_path / "tasks"
    _task(tasks, "ghost-agent", user_layout, "root", APP, "root", 'user = "ghost"|')
    _task(tasks, "ghost-verifier", user_layout, "root", "root", "root", '|user = "ghost"')
    results = await harbor_import.check([tasks], factory)
    for result, key in zip(results, ("[agent].user", "[verifier].user"), strict=True):
        assert (result.oracle, result.noop) == (None, None), result
        why = result.problems[0]
        assert "IMAGE_REJECTED: " in why and f"task.toml {key} 'ghost'" in why, why
    assert [r.task for r in results] == ["ghost-agent", "ghost-verifier"]


def test_task_toml_user_values(tmp_path: Path, user_layout: Path) -> None:
    folder = _task(tmp_path, "t", user_layout, "root", APP, APP, 'user = 1000|user = "app:staff"')
    loaded = taskdir.load(folder)
    assert (loaded.agent_user, loaded.verifier_user) == ("1000", "app:staff")
    assert "agent.user" not in loaded.unknown_keys
    for bad in ('user = ""', 'user = "a b"', "user = -1", "user = true", 'user = "$(x)"'):
        _task(tmp_path, "bad", user_layout, "root", APP, APP, f"{bad}|")
        with pytest.raises(TaskFolderError, match=r"\[agent\] user must be"):
            taskdir.load(tmp_path / "bad")
        shutil.rmtree(tmp_path / "bad")
