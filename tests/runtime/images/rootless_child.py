"""TEST-ONLY: run by test_rootless_images.py as an unprivileged user (no root, no capabilities):
image sandboxes as a rootless server makes them; prints what it saw as one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from rollout.runtime.sandbox import SandboxConfig, bwrap, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings


async def main(top: Path) -> dict[str, object]:
    cfg = SandboxConfig(state_dir=top / "state",
                        images=ImageSettings(cache_dir=str(top / "cache")))
    seen: dict[str, object] = {"euid": os.geteuid()}
    async with await create_sandbox(cfg, image=f"oci:{top}/layout:root") as sb:
        bash = await sb.bash()  # a launch that stays up while others come and go
        r = await sb.exec("id -u; echo hi > /etc/written; cat /etc/written")
        seen["root_exec"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
        seen["bash"] = (await bash.run("cat /etc/written; echo $BASH_VERSION")).output.split()
        r = await sb.exec("cat /etc/written; rm /etc/passwd; test -e /etc/passwd || echo gone")
        seen["second_launch"] = r.stdout.split()
        # /dev takes no write (bwrap's /dev is the server's user's tmpfs, without a size);
        # /dev/shm is the sandbox's folder, shared by its launches.
        r = await sb.exec("echo a > /dev/shm/a; : > /dev/x || echo dev-refused")
        r2 = await bash.run("cat /dev/shm/a")
        seen["dev"] = [r.stdout.split(), r2.output.split(),
                       (sb.path / "shm" / "a").exists()]  # type: ignore[attr-defined]
        # A grader's or verifier's launch after every process of the agent was killed still
        # enters the sandbox's overlay (its holder lives until teardown).
        await sb.stop_processes()
        r = await sb.exec("cat /etc/written")
        seen["after_stop"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
        image = sb.image.image  # type: ignore[attr-defined]
        # The upper layer is a tmpfs (the sandbox's disk quota) in the holder's namespace:
        # the host sees an empty folder, the holder's root the layer.
        holder, layer = sb._holder, top / "state" / bwrap.LAYER_DIR  # type: ignore[attr-defined]
        seen["upper_on_host"] = os.listdir(layer)
        seen["upper_written"] = Path(f"/proc/{holder.pid}/root{layer}/data/etc/"
                                     "written").read_text()
        with open(f"/proc/{holder.pid}/mountinfo", encoding="utf-8") as f:
            seen["upper_fs"] = [line.split(" - ")[1].split()[0] for line in f
                                if line.split()[4] == str(layer)]
        seen["cache_written"] = (image.rootfs / "etc" / "written").exists()
        seen["cache_passwd"] = (image.rootfs / "etc" / "passwd").exists()
    # Holders are made ahead: the next sandbox takes one of those, and a holder serves one
    # sandbox only (it ends with it and never comes back).
    for _ in range(600):
        pooled = bwrap._HOLDERS.ready()
        if len(pooled) == bwrap._HolderPool.size:
            break
        await asyncio.sleep(0.1)
    taken = []
    for _ in range(3):
        async with await create_sandbox(cfg, image=f"oci:{top}/layout:root") as sb:
            taken.append(sb._holder.pid)  # type: ignore[attr-defined]
            r = await sb.exec("cat /etc/passwd >/dev/null && echo fine")
            assert r.stdout.strip() == "fine", r
        assert not os.path.exists(f"/proc/{taken[-1]}") or _zombie(taken[-1]), taken
    seen["pool"] = {"ready_before": pooled, "taken": taken}
    # The quota: 4 MiB for writes into the image's root; 8 MiB do not fit.
    small = SandboxConfig(state_dir=top / "state", disk_bytes=4 << 20,
                          images=ImageSettings(cache_dir=str(top / "cache")))
    async with await create_sandbox(small, image=f"oci:{top}/layout:root") as sb:
        r = await sb.exec("head -c 8388608 /dev/zero > /big; echo $?; wc -c < /big; rm /big; "
                          "head -c 1048576 /dev/zero > /small && echo fits")
        seen["quota"] = [r.stdout.split(), r.stderr[-300:]]
        # ... and its files in number (tmpfs_inodes: 4,096 for 4 MiB).
        r = await sb.exec("i=0; while [ $i -lt 6000 ]; do : > /f$i 2>/dev/null || break; "
                          "i=$((i+1)); done; echo $i")
        seen["inodes"] = [r.stdout.strip(), r.stderr[-300:]]
    # No memory cgroup caps an unprivileged user's sandboxes: the live tmpfs layers' sizes
    # stay within memory_bytes (6 MiB: one 4 MiB layer); the next sandbox keeps its upper
    # layer on the disk, and once the first ends a new one gets a tmpfs again.
    tight = SandboxConfig(state_dir=top / "state", disk_bytes=4 << 20, memory_bytes=6 << 20,
                          images=ImageSettings(cache_dir=str(top / "cache")))
    async with (await create_sandbox(tight, image=f"oci:{top}/layout:root") as a,
                await create_sandbox(tight, image=f"oci:{top}/layout:root") as b):
        layers = [_upper_fs(sb, top) for sb in (a, b)]
        r = await b.exec("echo disk > /etc/b && cat /etc/b")
        seen["budget"] = [layers, r.stdout.split(),
                          (b.path / "upper" / "etc" / "b").exists()]  # type: ignore[attr-defined]
    async with await create_sandbox(tight, image=f"oci:{top}/layout:root") as sb:
        seen["budget_after"] = _upper_fs(sb, top)
    async with await create_sandbox(cfg, image=f"oci:{top}/layout:named") as sb:
        r = await sb.exec(["sh", "-c", "id -u; id -g; echo $HOME; echo x > $HOME/f && echo ok"])
        seen["named"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    async with await create_sandbox(cfg, image=f"oci:{top}/layout:named") as sb:
        # One command as the image's root ([verifier].user = "root" on an image of app).
        root = sb.user_for("root")  # type: ignore[attr-defined]
        r = await sb.exec(["sh", "-c", "id -u; echo $HOME"], user=root)  # type: ignore[call-arg]
        seen["as_root"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    # The fallback where the kernel refuses a rootless overlay, forced by the setting: a
    # private copy of the cached root, no holder, the same behaviour.
    copy_cfg = SandboxConfig(state_dir=top / "state",
                             images=ImageSettings(cache_dir=str(top / "cache"),
                                                  rootless_root="copy"))
    async with await create_sandbox(copy_cfg, image=f"oci:{top}/layout:root") as sb:
        bash = await sb.bash()
        r = await sb.exec("id -u; echo copied > /etc/written; cat /etc/written")
        seen["copy_exec"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
        seen["copy_bash"] = (await bash.run("cat /etc/written")).output.split()
        r = await sb.exec("rm /etc/passwd; test -e /etc/passwd || echo gone")
        seen["copy_second"] = r.stdout.split()
        image = sb.image.image  # type: ignore[attr-defined]
        seen["copy_holder"] = sb._holder is not None  # type: ignore[attr-defined]
        seen["copy_in_sandbox"] = (sb.path / "root" / "etc" / "written").read_text()  # type: ignore[attr-defined]
        seen["copy_cache_written"] = (image.rootfs / "etc" / "written").exists()
        seen["copy_cache_passwd"] = (image.rootfs / "etc" / "passwd").exists()
    async with await create_sandbox(copy_cfg, image=f"oci:{top}/layout:named") as sb:
        r = await sb.exec(["sh", "-c", "id -u; echo $HOME; echo x > $HOME/f && echo ok"])
        seen["copy_named"] = [r.exit_code, r.stdout.split(), r.stderr[-300:]]
    async with await create_sandbox(cfg) as sb:  # a plain sandbox of a rootless server
        r = await sb.exec("echo p > /dev/shm/p; cat /dev/shm/p; : > /dev/x || echo dev-refused")
        seen["plain_dev"] = [r.stdout.split(), r.stderr[-200:]]
    # The host's view: its masks are tmpfs mounts the server's user owns, without a size;
    # a job writes into none of them.
    host_cfg = SandboxConfig(state_dir=top / "state", host_view="host",
                             images=ImageSettings(cache_dir=str(top / "cache")))
    async with await create_sandbox(host_cfg) as sb:
        r = await sb.exec("for m in $(awk '$3 == \"tmpfs\" {print $2}' /proc/self/mounts); do "
                          "(: > $m/.w) 2>/dev/null && echo writable $m; done; echo checked")
        seen["host_view_tmpfs"] = [r.stdout.split(), r.stderr[-200:]]
    seen["sandboxes_left"] = os.listdir(cfg.sandboxes_dir)
    ready = bwrap._HOLDERS.ready()
    bwrap._HOLDERS.close()
    seen["pool_closed"] = [pid for pid in ready
                           if os.path.exists(f"/proc/{pid}") and not _zombie(pid)]
    return seen


def _upper_fs(sb: object, top: Path) -> str:
    """Where a sandbox's upper layer is: ``tmpfs`` (mounted in its holder's namespace) or
    ``disk`` (the sandbox's own folder)."""
    layer = top / "state" / bwrap.LAYER_DIR
    with open(f"/proc/{sb._holder.pid}/mountinfo", encoding="utf-8") as f:  # type: ignore[attr-defined]
        types = [line.split(" - ")[1].split()[0] for line in f
                 if line.split()[4] == str(layer)]
    if types == ["tmpfs"]:
        return "tmpfs"
    return "disk" if not types and (sb.path / "upper").is_dir() else f"? {types}"  # type: ignore[attr-defined]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
