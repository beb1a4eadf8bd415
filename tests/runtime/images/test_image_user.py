"""The image config's ``User`` applies: an image made in the test (the busybox image plus an
``app`` user in its own /etc/passwd and /etc/group, as ``useradd -m`` and ``USER app`` leave
it) runs its processes as that uid, resolved through the image's files, never the host's; the
tools work as that user; a user the image does not know is the task's fault."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path

import pytest

from rollout.runtime.handler import HandlerRegistry
from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import ImageError, UserRequest, cache_for, resolve_user
from rollout.runtime.sandbox.images.owners import decode, image_owners
from rollout.runtime.tools.editor import EditorTool
from rollout.runtime.types import JobSpec, JobState, Limits
from rollout.server.llm.scripted import ScriptedEngine
from rollout.server.scheduler import PipelineConfig, Scheduler
from rollout.server.store import JobStore
from tests.runtime.doubles import EngineClient, smollm2_tokenizer
from tests.runtime.images.test_image_jobs import ImageTaskHandler, _run

pytestmark = pytest.mark.timeout(300)

def _config(tmp_path: Path, settings: ImageSettings) -> SandboxConfig:
    return SandboxConfig(state_dir=tmp_path / "state", images=settings)


async def test_the_images_user_runs_every_tool(tmp_path: Path, user_layout: Path,
                                                image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings)
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:named") as sb:
        r = await sb.exec(["sh", "-c", "id -u; id -g; echo $HOME $USER; "
                           "echo mine > $HOME/notes && cat $HOME/notes; "
                           "echo ws > /workspace/w && echo tmp > /tmp/t && echo written"])
        assert r.ok, r.output
        assert r.stdout.split() == ["1000", "1001", "/home/app", "app", "mine", "written"]
        bash = await sb.bash()
        out = await bash.run("whoami 2>/dev/null || id -un; cd $HOME && pwd")
        assert out.exit_code == 0 and out.output.split()[-1] == "/home/app", out.output
        assert "app" in out.output
        # The seccomp filter still applies (the inner bwrap loads it on a root server).
        status = await sb.exec(["sh", "-c", "grep Seccomp: /proc/self/status"])
        assert status.stdout.split() == ["Seccomp:", "2"], status.output
        editor = EditorTool(sb)
        created = await editor({"command": "create", "path": "/workspace/a.py",
                                "file_text": "x = 1\n"})
        assert not created.is_error, created.output
        kernel = await sb.ipython()
        cell = await kernel.execute("import os; print(os.getuid(), os.getgid(), "
                                    "open('/workspace/a.py').read().strip())")
        assert cell.status == "ok" and "1000 1001 x = 1" in cell.output, cell.output
        if os.geteuid() == 0:
            # On a root server the user is an unprivileged one: the image's system files
            # stay as they are (a rootless server maps the whole image to its own user).
            r = await sb.exec(["sh", "-c", "echo x > /etc/passwd"])
            assert not r.ok and "denied" in r.output.lower()
        image = sb.image.image  # type: ignore[attr-defined]
        assert not (image.rootfs / "home" / "app" / "notes").exists()  # cache untouched


async def test_numeric_and_group_users(tmp_path: Path, user_layout: Path,
                                       image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings)
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:numeric") as sb:
        r = await sb.exec(["sh", "-c", "id -u; id -g; echo $HOME; touch /workspace/x && echo ok"])
        assert r.stdout.split() == ["4242", "4243", "/tmp/home", "ok"], r.output
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:grouped") as sb:
        r = await sb.exec(["sh", "-c", "id -u; id -g"])
        assert r.stdout.split() == ["1000", "50"], r.output
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:root") as sb:
        r = await sb.exec(["sh", "-c", "id -u"])
        if os.geteuid() != 0:  # a root server keeps its per-sandbox uid for the image's root
            assert r.stdout.split() == ["0"], r.output


def test_names_resolve_through_the_images_files_not_the_hosts(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("daemon:x:777:778::/srv/d:/bin/sh\n")
    # The host's root is uid 0 everywhere; in this image "daemon" is 777 (the host says 1).
    assert resolve_user(root, "daemon").uid == 777
    with pytest.raises(ImageError) as e:
        resolve_user(root, "root", image="oci:/x:y")
    assert e.value.reason == "IMAGE_REJECTED" and "'root'" in str(e.value)
    # /etc/passwd a link out of the image: never read from the host.
    (root / "etc" / "passwd").unlink()
    os.symlink("/etc/passwd", root / "etc" / "passwd")
    assert resolve_user(root, "0").uid == 0
    with pytest.raises(ImageError):
        resolve_user(root, "root")


async def test_an_unknown_user_fails_the_job_naming_the_task(
        tmp_path: Path, user_layout: Path, image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings)
    with pytest.raises(ImageError) as e:
        await create_sandbox(cfg, image=f"oci:{user_layout}:ghost")
    assert e.value.reason == "IMAGE_REJECTED" and "'ghost'" in str(e.value)
    assert not cfg.sandboxes_dir.exists() or os.listdir(cfg.sandboxes_dir) == []
    assert not any(entry.in_use for entry in cache_for(image_settings).entries())

    registry = HandlerRegistry()
    registry.register(ImageTaskHandler.name, ImageTaskHandler)
    store = JobStore(tmp_path / "jobs.sqlite3")
    await store.open()
    sched = Scheduler(store, registry, llm=EngineClient(ScriptedEngine(smollm2_tokenizer(), {})),
                      sandbox_factory=functools.partial(create_sandbox, cfg),
                      config=PipelineConfig(cleanup_deadline_s=10.0))
    await sched.start()
    try:
        finished, _ = await _run(sched, [JobSpec(
            job_id="ghost", environment="image-task",
            task={"id": "ghost-task", "image": f"oci:{user_layout}:ghost"},
            limits=Limits(init_timeout_s=200))])
    finally:
        await sched.stop(grace_s=0.0)
        await store.close()
    job = finished["ghost"]
    assert job.state == JobState.FAILED and job.reward is None
    assert (job.error.code, job.error.reason) == ("INVALID_TASK", "IMAGE_REJECTED")
    assert "task 'ghost-task'" in job.error.message and "ghost" in job.error.message


async def test_a_sandbox_runs_as_a_user_asked_for_and_one_command_as_another(
        tmp_path: Path, user_layout: Path, image_settings: ImageSettings) -> None:
    # What a Harbor task's [agent].user / [verifier].user need: the sandbox's user replaced
    # (an image whose User is root runs as app), and one command as another user (root in a
    # sandbox of app), each with that user's HOME.
    cfg = _config(tmp_path, image_settings)
    who = ["sh", "-c", "echo $(id -u) $HOME; touch /etc/probe 2>/dev/null && echo wrote-etc"]
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:root", user="app") as sb:
        r = await sb.exec(who)
        assert r.stdout.split()[:2] == ["1000", "/home/app"], r.output
        root = await asyncio.to_thread(sb.user_for, "root")  # type: ignore[attr-defined]
        r = await sb.exec(who, user=root)  # type: ignore[call-arg]
        assert r.stdout.split()[1:] == ["/tmp/home", "wrote-etc"], r.output
        assert r.stdout.split()[0] != "1000"
        bash = await sb.bash()  # the tools stay the sandbox's user
        out = await bash.run("id -u")
        assert out.output.split()[-1] == "1000", out.output
    async with await create_sandbox(cfg, image=f"oci:{user_layout}:named") as sb:
        r = await sb.exec(who)
        assert r.stdout.split()[:2] == ["1000", "/home/app"], r.output
        root = await asyncio.to_thread(sb.user_for, "0")  # type: ignore[attr-defined]
        r = await sb.exec(who, user=root)  # type: ignore[call-arg]
        assert r.stdout.split()[1:] == ["/tmp/home", "wrote-etc"], r.output
        with pytest.raises(ImageError) as e:
            sb.user_for("ghost", named_by="task.toml [verifier].user")  # type: ignore[attr-defined]
        assert e.value.reason == "IMAGE_REJECTED"
        assert "task.toml [verifier].user 'ghost'" in str(e.value)
    with pytest.raises(ImageError) as e:
        await create_sandbox(cfg, image=f"oci:{user_layout}:root",
                             user=UserRequest("nobody-here", named_by="task.toml [agent].user"))
    assert "task.toml [agent].user 'nobody-here'" in str(e.value)
    assert os.listdir(cfg.sandboxes_dir) == []


def test_owners_are_read_from_the_rootless_unpacks_xattrs() -> None:
    # rootlesscontainers.com's Resource: field 1 uid, field 2 gid (varints); absent = 0.
    assert decode(b"\x08\xe8\x07\x10\xe9\x07") == (1000, 1001)
    assert decode(b"\x10\x05") == (0, 5) and decode(b"") == (0, 0)
    assert decode(b"\x08\xff\xff\xff\xff\x0f") == (0, 0)  # "unchanged"
    assert decode(b"\x1a\x00") is None and decode(b"\x08") is None


async def test_the_images_owners_apply_to_its_user(tmp_path: Path, owned_layout: Path,
                                                   image_settings: ImageSettings) -> None:
    cfg = _config(tmp_path, image_settings)
    async with await create_sandbox(cfg, image=f"oci:{owned_layout}:owned") as sb:
        image = sb.image.image  # type: ignore[attr-defined]
        assert sorted(image_owners(str(image.rootfs))) == [
            ("app", 1000, 1001), ("app/group.txt", 0, 1001), ("app/owned.txt", 1000, 1001),
            ("srv/other", 1002, 1002)]
        r = await sb.exec(["sh", "-c", "stat -c '%u:%g' /app/owned.txt; "
                           "echo v2 >> /app/owned.txt && echo own-ok; "
                           "touch /app/new && echo dir-ok; "
                           "echo g2 >> /app/group.txt && echo group-ok; "
                           "echo x >> /rootfile 2>/dev/null || echo root-denied; "
                           "touch /srv/other/x 2>/dev/null || echo other-denied"])
        if os.geteuid() == 0:
            # A root server: the user owns what its image gave it, and nothing else.
            assert r.stdout.split() == ["1000:1001", "own-ok", "dir-ok", "group-ok",
                                        "root-denied", "other-denied"], r.output
        else:
            # A rootless server: the user is the server's user, which owns every file.
            assert r.stdout.split()[1:4] == ["own-ok", "dir-ok", "group-ok"], r.output
        assert (image.rootfs / "app" / "owned.txt").read_text() == "v1\n"  # cache untouched
        assert os.stat(image.rootfs / "app" / "owned.txt").st_uid == os.geteuid()
