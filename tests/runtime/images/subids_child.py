"""TEST-ONLY: run by test_rootless_images.py as a user with a range in /etc/subuid and
/etc/subgid (no root, no capabilities): image sandboxes of a rootless server whose user
namespaces map the image's uids; prints what it saw as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from rollout.runtime.sandbox import SandboxConfig, bwrap, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings, SandboxError
from rollout.runtime.sandbox.images import subids

PROBE = ("id -u; stat -c '%u:%g' /app/owned.txt /rootfile /etc/passwd; "
         "echo v2 >> /app/owned.txt && echo own-ok; touch /app/new && echo dir-ok; "
         "echo g2 >> /app/group.txt && echo group-ok; "
         "echo x >> /rootfile 2>/dev/null && echo root-written || echo root-denied; "
         "echo x >> /etc/passwd 2>/dev/null && echo passwd-written || echo passwd-denied; "
         "touch /srv/other/x 2>/dev/null && echo other-written || echo other-denied; "
         "echo w > /workspace/w && echo ws-ok; echo h > $HOME/h && echo home-ok")


async def main(top: Path) -> dict[str, object]:
    seen: dict[str, object] = {"euid": os.geteuid(), "subids": str(subids.server_subids())}
    # A teardown removes the users' files in the sandbox's own namespace: a fresh one (the
    # crash sweep's way, and the fallback) is never needed while the holder lives.
    fresh: list[str] = []
    remove_mapped = bwrap.remove_mapped

    def counted(path: Path, *args: Any, **kwargs: Any) -> None:
        fresh.append(path.name)
        remove_mapped(path, *args, **kwargs)

    bwrap.remove_mapped = counted  # type: ignore[assignment]
    seen["fresh_namespace_removals"] = fresh
    ref = f"oci:{top}/layout:owned"
    for mode in ("auto", "copy"):
        cfg = SandboxConfig(state_dir=top / "state", images=ImageSettings(
            cache_dir=str(top / "cache"), rootless_root=mode))
        async with await create_sandbox(cfg, image=ref) as sb:
            r = await sb.exec(["sh", "-c", PROBE])
            seen[f"{mode}_app"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
            if mode == "auto":
                await more(sb, seen)
        async with await create_sandbox(cfg, image=ref, user="root") as sb:
            r = await sb.exec(["sh", "-c", "id -u; stat -c '%u:%g' /app/owned.txt; "
                               "echo x >> /etc/passwd && echo passwd-ok; "
                               "echo x >> /app/owned.txt && echo app-file-ok"])
            seen[f"{mode}_root"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
            image = sb.image.image  # type: ignore[attr-defined]
    # A grader's fresh sandbox gets a copy of the agent's workspace (files app made 0600
    # included), both of app; each workspace is app's again after.
    async with await create_sandbox(cfg, image=ref) as agent, \
            await create_sandbox(cfg, image=ref) as grader:
        await agent.exec("mkdir /workspace/src && echo s > /workspace/src/f && "
                         "chmod 600 /workspace/src/f && chmod 700 /workspace/src")
        await agent.stop_processes()
        copied = await grader.copy_workspace_from(agent)
        r = await grader.exec("cat /workspace/src/f; stat -c %u:%g /workspace/src/f; "
                              "echo g >> /workspace/src/f && echo grader-ok")
        a = await agent.exec("echo a >> /workspace/src/f && echo agent-ok")
        seen["copy"] = [copied, r.exit_code, r.stdout.split(), a.stdout.split()]
    # An image whose user, or a file's owner, lies beyond the server's range is refused,
    # naming the id, the range and the fix (never run with the wrong owners).
    for tag in ("far", "far-owner"):
        try:
            async with await create_sandbox(cfg, image=f"oci:{top}/layout:{tag}"):
                seen[tag] = "created"
        except SandboxError as e:
            seen[tag] = [e.reason, str(e)]
    seen["cache_rootfile"] = (image.rootfs / "rootfile").read_text()
    seen["cache_owned"] = (image.rootfs / "app" / "owned.txt").read_text()
    seen["cache_uids"] = sorted({os.lstat(os.path.join(d, n)).st_uid
                                 for d, dirs, files in os.walk(image.rootfs)
                                 for n in dirs + files})
    seen["sandboxes_left"] = os.listdir(cfg.sandboxes_dir)
    return seen


async def more(sb: Any, seen: dict[str, object]) -> None:
    """The tools in the app sandbox: the bash tool, one command as the image's root."""
    bash = await sb.bash()  # the tool's long-lived bash, as the image's user
    seen["bash"] = (await bash.run("id -u; echo b > /workspace/b; cat /workspace/b; "
                                   "echo y >> /rootfile || echo denied")).output.split()
    # The server's own file API (the editor tool, a pooled sandbox's files) writes and
    # removes workspace files of the image's user: given to that user, who writes them on.
    await sb.put_file("ed/new.txt", "e\n")
    await sb.put_file("/workspace/b", "server\n")  # the user's own file, 0644
    r = await sb.exec("stat -c %u:%g /workspace/ed /workspace/ed/new.txt /workspace/b; "
                      "cat /workspace/b; echo more >> /workspace/ed/new.txt && echo app-ok")
    seen["put_file"] = [r.exit_code, r.stdout.split(), r.stderr[-300:],
                        (await sb.get_file("ed/new.txt")).decode()]
    await sb.remove_file("ed/new.txt")
    errors = []
    for bad in ("ed/new.txt", "", "../x"):
        try:
            await (sb.remove_file(bad) if bad == "ed/new.txt" else sb.put_file(bad, "x"))
        except OSError as e:
            errors.append(type(e).__name__)
    seen["file_errors"] = errors
    root = sb.user_for("root")
    r = await sb.exec(["sh", "-c", "id -u; echo r >> /rootfile && echo root-ok; "
                       "echo r >> /app/owned.txt && echo app-file-ok"], user=root)
    seen["as_root"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    seen["holder"] = sb._holder is not None
    # A command as another non-root user (a task's tests run as their own user) writes the
    # workspace, its files and a folder of the sandbox's user; the sandbox's user then still
    # writes what that command made.
    r = await sb.exec("mkdir -p /workspace/mine && echo m > /workspace/mine/f")
    other = sb.user_for("1002:1002")
    r = await sb.exec(["sh", "-c", "id -u; echo o >> /workspace/b && echo ws-file-ok; "
                       "echo o > /workspace/mine/o && echo ws-dir-ok; "
                       "mkdir /workspace/theirs && echo t > /workspace/theirs/t && echo ws-new-ok; "
                       "echo o > /rootfile || echo root-denied"], user=other)
    seen["other_user"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    r = await sb.exec("id -u; echo a >> /workspace/theirs/t && echo back-ok; "
                      "stat -c %u /workspace/theirs/t /workspace/b")
    seen["after_other"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
