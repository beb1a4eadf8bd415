"""Config loading (errors name the key) and the metrics outputs (CSV, PNG, bootstrap CI)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from rich.console import Console

from rollout.trainer_adapters.dapo.metrics import COLUMNS, MetricsLog, paired_bootstrap
from rollout.trainer_adapters.dapo.run_config import load_config

SHIPPED = Path(__file__).resolve().parents[3] / "trainer_adapters" / "dapo" / "smollm2_cpu.toml"


def test_shipped_config_loads_and_overrides_apply() -> None:
    cfg = load_config(SHIPPED, {"run.steps": 3, "algo.lr": 1})
    assert cfg.run.steps == 3 and cfg.algo.lr == 1.0 and cfg.batch.group_size == 4


@pytest.mark.parametrize("overrides,match", [
    ({"algo.nope": 1}, r"unknown key\(s\) \['nope'\] in \[algo\]"),
    ({"nope.x": 1}, r"unknown config section \[nope\]"),
    ({"run.steps": "ten"}, "run.steps must be a int"),
    ({"algo.kl_coef": 0.1}, "kl_coef"),
    ({"service.weight_sync": "nccl"}, "weight_sync"),
    ({"algo.overlong_cache": 64}, "overlong_cache"),
])
def test_bad_config_names_the_key(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_paired_bootstrap_by_hand() -> None:
    # Every task flips from wrong to right: the difference is exactly +1 in every resample.
    assert paired_bootstrap([0, 0, 0], [1, 1, 1]) == (1.0, 1.0, 1.0)
    # Nothing changes: [0, 0].
    assert paired_bootstrap([1, 0], [1, 0]) == (0.0, 0.0, 0.0)
    mean, lo, hi = paired_bootstrap([0] * 50 + [1] * 50, [1] * 60 + [0] * 40)
    assert mean == pytest.approx(0.1) and lo < 0.1 < hi


def test_metrics_log_writes_csv_and_png(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, Console(file=open(tmp_path / "console.txt", "w")))
    log.log({"step": 0, "policy_version": 0, "heldout_accuracy": 0.25})
    log.log({"step": 1, "policy_version": 1, "accuracy": 0.5, "entropy": 1.2,
             "clip_low": 0.01, "clip_high": 0.02, "generation_rounds": 2,
             "stale_dropped": 3, "cancelled_samples": 4})
    log.close()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert list(rows[0]) == list(COLUMNS)
    assert rows[1]["stale_dropped"] == "3" and rows[0]["heldout_accuracy"] == "0.25"
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_after_one_step_every_panel_shows_a_point_or_says_why_not(tmp_path: Path) -> None:
    """A newcomer's first run showed 8 of 10 panels empty after one step: a line with one
    point draws nothing unless it has a marker."""
    console_file = tmp_path / "console.txt"
    log = MetricsLog(tmp_path, Console(file=open(console_file, "w"), width=400))
    log.log({"step": 1, "policy_version": 1, "accuracy": 0.5, "reward_mean": 0.4,
             "kept_group_ratio": 0.75, "entropy": 1.2, "clip_low": 0.01, "clip_high": 0.02,
             "response_length": 30.0, "generation_rounds": 1, "stale_dropped": 0,
             "cancelled_samples": 0, "turns": 2.0, "tool_calls": 1.0,
             "mismatch_kl_token": 0.01, "mismatch_kl_seq": 0.2, "mismatch_masked": 0.0,
             "mismatch_weight_mean": 1.0, "peak_rss_gib": 1.5})
    fig = log.figure()
    shown = 0
    for ax in fig.axes:
        if not ax.get_title():
            continue  # a spare cell of the grid
        points = [line for line in ax.get_lines() if len(line.get_xdata()) > 0
                  and line.get_marker() not in (None, "None", "", " ")]
        said = [t.get_text() for t in ax.texts]
        assert points or said, f"panel {ax.get_title()!r} is empty and says nothing"
        shown += bool(points)
    # Only the held-out panels have nothing after a training step; they say so.
    assert shown == sum(1 for ax in fig.axes if ax.get_title()) - 2
    log.log({"step": 2, "policy_version": 2, "accuracy": 0.6})
    log.close()
    text = console_file.read_text()
    assert text.count("fields of each step line") == 1  # the legend, once, above step 1
    # Every label the step line uses is explained in the legend.
    for label in ("acc", "reward", "kept", "rounds", "stale", "cancel", "H", "clip", "len",
                  "turns", "tools", "roll", "train", "t", "rss"):
        assert f"{label} " in text.split("\n", 1)[1]
        assert f" {label} =" in text or f"; {label} " in text or f"{label} =" in text, label


HEAP_SCRIPT = """
import ctypes, sys
from pathlib import Path
from rollout.trainer_adapters.dapo.metrics import map_large_allocations
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
if sys.argv[1] == "on":
    map_large_allocations()
big = libc.malloc(16 << 20); ctypes.memset(big, 1, 16 << 20); libc.free(big)
blocks, pins = [], []
for _ in range(64):
    b = libc.malloc(4 << 20); ctypes.memset(b, 1, 4 << 20); blocks.append(b)
    pins.append(libc.malloc(256 << 10))
before = rss()
for b in blocks:
    libc.free(b)
print((before - rss()) >> 20)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_freed_large_allocations_leave_the_process() -> None:
    """After map_large_allocations, 64 freed 4 MiB blocks (each pinned in place by a 256 KiB
    allocation after it) leave resident memory; by default, once a 16 MiB block has been freed,
    glibc keeps them in its heap."""
    import subprocess
    import sys

    def released(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", HEAP_SCRIPT, mode], capture_output=True,
                             text=True, timeout=120, check=True)
        return int(out.stdout.strip())

    assert released("on") >= 200
    assert released("off") < 64
