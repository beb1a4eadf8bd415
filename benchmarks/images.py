"""``rollout bench images``: container images as sandbox roots, beside the plain sandbox.

Measured in one run on this machine, on an image made here with ``umoci`` (a static busybox,
or with ``--base`` the cached Debian base image that ``scripts/setup_images.sh`` builds):

* **cold**: fetch (``skopeo copy``) + layer checks + unpack (``umoci unpack --rootless``) of the
  image into an empty cache;
* **warm**: a sandbox rooted at the cached image (read-only lower layer, per-sandbox
  copy-on-write upper) created and its first command run (its start), then destroyed,
  interleaved with the same for a plain bubblewrap sandbox (the host's minimal view): p50 /
  p95 of the start, of the destroy and of the two together, and the ratios;
* **concurrent first use**: N sandboxes on one image not yet in a fresh cache, started at
  once: one fetch serves them all.

Goal: a warm image sandbox starts within 1.5x of the plain one (p50); the whole lifecycle's
ratio is printed beside it, as a job pays for the destroy too before its result is delivered
(the pipeline frees what a job holds first). The title says which path was
measured: a root server, or a rootless one (run the bench as that user) with or without its
subordinate ids mapped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollout.runtime.sandbox import SandboxConfig, create_sandbox
from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import cache_for, prepare_image, subids

GOAL_RATIO = 1.5
APPLETS = ("sh", "true", "cat", "echo", "ls")


def busybox_layout(dest: Path) -> str:
    """An OCI layout at ``dest`` of one layer (a static busybox and a few applet links);
    returns its reference."""
    busybox = next((p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.isfile(p)), None)
    if busybox is None:
        raise SystemExit("busybox-static is not installed (bash scripts/setup_images.sh)")
    tree = dest.parent / "tree"
    (tree / "bin").mkdir(parents=True)
    shutil.copy2(busybox, tree / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", tree / "bin" / applet)
    for args in (["init", "--layout", str(dest)], ["new", "--image", f"{dest}:bb"],
                 ["insert", "--rootless", "--image", f"{dest}:bb", str(tree), "/"]):
        subprocess.run(["umoci", *args], check=True, capture_output=True, timeout=120)
    return f"oci:{dest}:bb"


def base_reference() -> str:
    """The test set-up's cached Debian base image (an OCI layout tagged ``base``)."""
    cache = Path(os.environ.get("ROLLOUT_SETUP_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                 / "rollout-service")
    layout = (cache / "current-image-base").resolve()
    if not (layout / "index.json").is_file():
        raise SystemExit(f"no cached base image under {cache} (bash scripts/setup_images.sh)")
    return f"oci:{layout}:base"


def server_mode() -> str:
    """Which path an image sandbox takes here: a root server mounts one overlay on the host;
    a rootless one mounts it in a user namespace of its own, mapping its subordinate ids
    (``newuidmap``) when it has a range, else only its own uid."""
    if os.geteuid() == 0:
        return "root server"
    ids = subids.server_subids()
    return (f"rootless server, {ids.count} subordinate ids mapped" if ids is not None
            else "rootless server, its own uid only")


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def _timed(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return (time.perf_counter() - t) * 1e3


async def run(args: argparse.Namespace, console: Console) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench-images-"))
    try:
        ref = base_reference() if args.base else busybox_layout(work / "layout")
        state = work / "state"

        def settings(name: str) -> ImageSettings:
            return ImageSettings(cache_dir=str(work / name))

        cold = []
        for i in range(args.cold):
            t = time.perf_counter()
            await asyncio.to_thread(prepare_image, ref, settings(f"cold-{i}"))
            cold.append((time.perf_counter() - t) * 1e3)

        warm_settings = settings("warm")
        await asyncio.to_thread(prepare_image, ref, warm_settings)
        image_cfg = SandboxConfig(runtime="bwrap", state_dir=state, images=warm_settings)
        plain_cfg = SandboxConfig(runtime="bwrap", state_dir=state)

        async def one(cfg: SandboxConfig, image: str | None) -> tuple[float, float]:
            """(start ms: created + first command, destroy ms) of one sandbox."""
            t = time.perf_counter()
            sb = await create_sandbox(cfg, image=image)
            try:
                res = await sb.exec("echo ok")
                assert res.stdout.strip() == "ok", res
            finally:
                started = time.perf_counter()
                await sb.destroy()
            return (started - t) * 1e3, (time.perf_counter() - started) * 1e3

        for _ in range(3):  # warm-up: the minimal view's /etc, the cgroup, page cache
            await one(image_cfg, ref)
            await one(plain_cfg, None)
        warm: list[tuple[float, float]] = []
        plain: list[tuple[float, float]] = []
        for _ in range(args.iterations):  # interleaved: both see the same load
            warm.append(await one(image_cfg, ref))
            plain.append(await one(plain_cfg, None))

        fresh = settings("concurrent")
        conc_cfg = SandboxConfig(runtime="bwrap", state_dir=state, images=fresh)

        async def first_use() -> None:
            sb = await create_sandbox(conc_cfg, image=ref)
            try:
                await sb.exec("true")
            finally:
                await sb.destroy()

        t = time.perf_counter()
        await asyncio.gather(*(first_use() for _ in range(args.concurrent)))
        conc_ms = (time.perf_counter() - t) * 1e3
        entries = len(cache_for(fresh).entries())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    columns = {"start": [w[0] for w in warm], "destroy": [w[1] for w in warm],
               "lifecycle": [sum(w) for w in warm]}
    base = {"start": [b[0] for b in plain], "destroy": [b[1] for b in plain],
            "lifecycle": [sum(b) for b in plain]}
    ratios = {k: statistics.median(columns[k]) / statistics.median(base[k]) for k in columns}
    table = Table(title=f"rollout bench images ({'Debian base' if args.base else 'busybox'} "
                        f"image; {server_mode()}; ms; measured in this run; load "
                        f"{os.getloadavg()[0]:.1f})")
    for col in ("measurement", "n", "p50", "p95", "image / plain p50"):
        table.add_column(col, justify="left" if col == "measurement" else "right")
    table.add_row("cold: fetch + check + unpack into an empty cache", str(len(cold)),
                  f"{statistics.median(cold):.1f}", f"{_pct(cold, 0.95):.1f}", "")
    for key, what in (("start", "start (create + first command)"), ("destroy", "destroy"),
                      ("lifecycle", "start + destroy")):
        table.add_row(f"warm: image sandbox {what}", str(len(warm)),
                      f"{statistics.median(columns[key]):.2f}",
                      f"{_pct(columns[key], 0.95):.2f}", f"{ratios[key]:.2f}x")
        table.add_row(f"baseline: plain bwrap sandbox {what}", str(len(plain)),
                      f"{statistics.median(base[key]):.2f}", f"{_pct(base[key], 0.95):.2f}", "")
    table.add_row(f"concurrent first use: {args.concurrent} sandboxes on one uncached image",
                  "1", f"{conc_ms:.1f}", "", "")
    console.print(table)
    met = ratios["start"] <= GOAL_RATIO
    console.print(f"warm image / plain start p50: {ratios['start']:.2f}x (goal ≤ {GOAL_RATIO}x: "
                  f"{'met' if met else 'missed'}); start + destroy: {ratios['lifecycle']:.2f}x; "
                  f"images in the cache after the concurrent first use: {entries} (one fetch "
                  "served every sandbox)")
    return 1 if args.strict and not met else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollout bench images", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--iterations", type=int, default=50,
                        help="warm and plain sandboxes each (default 50)")
    parser.add_argument("--cold", type=int, default=3, help="cold fetches (default 3)")
    parser.add_argument("--concurrent", type=int, default=8,
                        help="sandboxes started at once on an uncached image (default 8)")
    parser.add_argument("--base", action="store_true",
                        help="the cached Debian base image instead of busybox")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when the goal is missed (noisy machines: off by default)")
    args = parser.parse_args(argv)
    return asyncio.run(run(args, Console()))


if __name__ == "__main__":
    raise SystemExit(main())
