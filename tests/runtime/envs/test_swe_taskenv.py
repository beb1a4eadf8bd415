"""Per-task environments of swe tasks: built once per repository/version/spec from the
wheelhouse, bound read-only into every job, and what goes wrong without them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from rollout.runtime.envs.swe import handler as swe_env
from rollout.runtime.envs.swe.handler import SweHandler
from rollout.runtime.envs.swe.taskenv import SHIPPED_WHEELHOUSE, EnvSpec, user_wheelhouses
from rollout.runtime.handler import JobContext
from rollout.runtime.tasksets.shipped import fill_wheelhouse, load_tasks
from rollout.runtime.types import InvalidArgument
from tests.runtime.envs.conftest import Rollout, call

pytestmark = pytest.mark.timeout(240)

TASKS = {t["instance_id"]: t for t in load_tasks("swe")}
MDURL, UNITCONV = TASKS["rollout__mdurl-1"], TASKS["rollout__unitconv-1"]
SUBMIT = call("submit", answer="fixed")


@pytest.fixture(scope="module", autouse=True)
def wheelhouse() -> None:
    try:
        fill_wheelhouse([MDURL, UNITCONV], user_wheelhouses()[0])
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the wheelhouse could not be filled (registry access is needed once): "
                    f"{str(e)[:300]}")


def without_spec(task: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k not in ("spec", "version")}


def gold(task: dict[str, Any]) -> str:
    return call("bash", command=f"git apply <<'PATCH_EOF'\n{task['patch']}PATCH_EOF\n")


async def test_on_the_servers_interpreter_a_colliding_package_pays_a_no_op(
        rollout: Rollout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the isolation: the server's venv has a real ``mdurl``; without the task's
    environment, and without src/ on the path (which the grader adds for a plain task: see
    test_swe_env), the tests import that copy and a no-op earns 1 (with either: 0)."""
    monkeypatch.setattr(swe_env, "import_paths", lambda task, found: [])
    result = await rollout(SweHandler(), without_spec(MDURL), [SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_a_wheelhouse_only_dependency_needs_the_environment(rollout: Rollout) -> None:
    result = await rollout(SweHandler(), without_spec(UNITCONV), [gold(UNITCONV), SUBMIT])
    assert result.reward.value == 0.0  # tinyunits is nowhere but in the wheelhouse
    assert "No module named 'tinyunits'" in result.reward.info["error"], result.reward.info
    result = await rollout(SweHandler(), UNITCONV, [gold(UNITCONV), SUBMIT])
    assert result.reward.value == 1.0, result.reward.info


async def test_environment_is_built_once_then_bound_read_only(
        rollout: Rollout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUT_SWE_ENV_CACHE", str(tmp_path / "envs"))
    # Offline from the shipped wheelhouse alone: the user's wheelhouse is an empty folder.
    (tmp_path / "no-wheels").mkdir()
    monkeypatch.setenv("ROLLOUT_WHEELHOUSE", str(tmp_path / "no-wheels"))
    views: list[str] = []

    async def look(ctx: JobContext) -> None:
        sandbox = ctx.state["env.sandbox"]
        out = await sandbox.exec(
            "python -c 'import sys, pytest, mdurl; print(sys.prefix, pytest.__version__, "
            "mdurl.__file__)'; touch /.rollout-env/venv/planted 2>&1 | grep -c 'Read-only'",
            timeout=60)
        views.append(out.stdout)

    for _ in range(2):
        result = await rollout(SweHandler(), MDURL, [gold(MDURL), SUBMIT], inspect=look)
        assert result.reward.value == 1.0, result.reward.info
    key = EnvSpec.of(MDURL).key  # type: ignore[union-attr]
    assert [p.name for p in (tmp_path / "envs").iterdir() if not p.name.startswith(".")] == [key]
    ready = tmp_path / "envs" / key / "ready"
    assert ready.is_file() and "pytest==8.3.5" in (ready.parent / "freeze.txt").read_text()
    for view in views:
        prefix, version, module, read_only = view.split()
        assert (prefix, version) == ("/.rollout-env/venv", "8.3.5")
        assert module == "/workspace/src/mdurl/__init__.py"  # the editable install
        assert read_only == "1"


@pytest.mark.parametrize(("spec", "field"), [
    ({"pip_packages": "pytest"}, "task.spec.pip_packages"),
    ({"python": "2.7"}, "task.spec.python"),
    ({"python": "three"}, "task.spec.python"),
    ({"install": ["pip", "install"]}, "task.spec.install"),
    ({"docker_image": "x"}, "task.spec"),
])
def test_bad_specs_name_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        SweHandler().validate_task({**MDURL, "spec": spec})
    assert err.value.field == field, str(err.value)


def test_vendored_wheels_match_their_recorded_hashes() -> None:
    listed = {}
    for line in (SHIPPED_WHEELHOUSE / "SOURCES.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            digest, name = line.split()
            listed[name] = digest
    assert set(listed) == {p.name for p in SHIPPED_WHEELHOUSE.glob("*.whl")}
    for name, digest in listed.items():
        assert hashlib.sha256((SHIPPED_WHEELHOUSE / name).read_bytes()).hexdigest() == digest
