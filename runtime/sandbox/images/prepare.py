"""Ahead-of-time pulls and builds with progress bars (``rollout tasks prepare``).

Each distinct image source gets one row that follows its stages (waiting for another process,
fetching, checking, unpacking, building, exporting) and ends with what happened; a failure is
reported on its row and in the result, never stops the other images. A few run at once: a
fetch mostly waits on the network, an unpack on the disk.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from rollout.runtime.sandbox.base import ImageSettings
from rollout.runtime.sandbox.images import (
    CachedImage,
    ImageError,
    ImageSource,
    lookup_image,
    prepare_image,
    source_label,
)


@dataclass(frozen=True)
class Prepared:
    """One source's outcome: the image, or the error that refused it."""

    source: str
    image: CachedImage | None = None
    error: ImageError | None = None
    seconds: float = 0.0

    def row(self) -> dict[str, object]:
        if self.image is not None:
            return {"image": self.source, "action": self.image.action,
                    "digest": self.image.digest, "size_bytes": self.image.size_bytes,
                    "seconds": self.seconds, "path": str(self.image.rootfs)}
        assert self.error is not None
        return {"image": self.source, "action": "failed", "reason": self.error.reason,
                "error": str(self.error)}


def prepare_images(sources: Sequence[ImageSource], settings: ImageSettings | None = None, *,
                   parallel: int = 3, stream: IO[str] | None = None,
                   refresh: bool = False) -> list[Prepared]:
    """Make every source ready in the cache (blocking), with one progress row each on
    ``stream`` (stderr by default; plain lines where it is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    unique: dict[str, ImageSource] = {}
    for src in sources:
        unique.setdefault(source_label(src), src)
    console = Console(file=stream or sys.stderr)
    columns = (SpinnerColumn(), TextColumn("{task.fields[name]}", style="bold"),
               BarColumn(bar_width=20), TextColumn("{task.fields[stage]}"),
               TimeElapsedColumn())
    steps = {"waiting": 0, "fetching": 1, "building": 1, "checking": 2, "exporting": 2,
             "unpacking": 3, "done": 4}
    results: dict[str, Prepared] = {}
    with Progress(*columns, console=console, transient=False) as bars:
        ids = {label: bars.add_task(label, total=4, name=_short(label), stage="queued")
               for label in unique}

        def one(label: str, src: ImageSource) -> None:
            started = time.monotonic()
            cached = None if refresh else lookup_image(src, settings)
            if cached is not None:
                bars.update(ids[label], completed=4, stage="cached")
                results[label] = Prepared(label, cached)
                return

            def note(stage: str) -> None:
                bars.update(ids[label], completed=steps.get(stage, 0), stage=stage)

            try:
                image = prepare_image(src, settings, progress=note, refresh=refresh)
            except ImageError as e:
                bars.update(ids[label], stage=f"[red]failed: {e.reason}")
                results[label] = Prepared(label, error=e)
                return
            took = round(time.monotonic() - started, 2)
            bars.update(ids[label], completed=4, stage=f"{image.action} ({took:g} s)")
            results[label] = Prepared(label, image, seconds=took)

        with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
            for future in [pool.submit(one, label, src) for label, src in unique.items()]:
                future.result()
    return [results[label] for label in unique]


def _short(label: str, width: int = 60) -> str:
    return label if len(label) <= width else "..." + label[-(width - 3):]
