"""Per-step metrics: a rich console line, ``metrics.csv``, TensorBoard when installed, and a
PNG of the curves (``curves.png``) redrawn after every step so a run that is stopped early still
leaves its picture."""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

COLUMNS = (
    "step", "policy_version", "reward_mean", "accuracy", "heldout_accuracy", "turns",
    "tool_calls", "heldout_turns", "heldout_tool_calls", "kept_group_ratio",
    "generation_rounds", "groups_dropped_equal", "groups_cancelled", "cancelled_samples",
    "stale_dropped", "failed_samples", "entropy", "clip_low", "clip_high", "dual_clip",
    "tis_truncated", "approx_kl", "loss", "grad_norm", "lr", "response_length",
    "rollout_tokens_per_s", "train_tokens_per_s", "time_rollout_s", "time_train_s",
    "time_push_s", "time_eval_s", "peak_rss_gib", "rss_update_start_gib", "mismatch_kl_token",
    "mismatch_kl_seq",
    "mismatch_masked", "mismatch_weight_mean", "elapsed_s",
)
"""``accuracy``: fraction of all completed training samples of the step with reward 1 (before
dynamic sampling); ``reward_mean``: mean shaped reward of the kept samples the loss saw;
``turns`` / ``tool_calls``: per episode, over the same samples as ``accuracy``; ``heldout_*``:
the same over the held-out evaluation; ``peak_rss_gib``: the process's peak resident memory
during the step (rollouts, update and push; with an in-process server it includes the server);
``rss_update_start_gib``: resident memory when the update starts (after the rollouts);
``mismatch_*``: rollout-vs-trainer mismatch before the update (see ``loss.mismatch_metrics``)."""


def reset_peak_rss() -> None:
    """Start a new peak-RSS window: Linux resets ``VmHWM`` on writing 5 to ``clear_refs``
    (a no-op where that is not allowed)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def release_free_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc ``malloc_trim``): the
    rollouts' tensors, freed by the engine's worker thread, otherwise stay resident in its
    arena while the update allocates in another thread's, and both count in the step's peak.
    A no-op where the C library has no ``malloc_trim``."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


LARGE_ALLOCATION = 1 << 20
"""Bytes from which the C allocator maps memory for its own (see :func:`map_large_allocations`)."""


def map_large_allocations() -> None:
    """Make glibc serve every allocation of :data:`LARGE_ALLOCATION` bytes or more with its own
    mapping, returned to the system when freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops
    glibc raising that threshold after each large free). By default a freed tensor of up to
    32 MiB stays in the heap, and the layers' recomputed activations leave a model's worth of
    free heap resident from the second update on. A no-op where the C library has no
    ``mallopt``."""
    import ctypes
    import ctypes.util

    m_mmap_threshold = -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(m_mmap_threshold, LARGE_ALLOCATION)
    except (OSError, AttributeError):
        pass


def rss_gib() -> float | str:
    """Resident memory now (``VmRSS``), in GiB; ``""`` where /proc is not available."""
    return _status_gib("VmRSS:")


def peak_rss_gib() -> float | str:
    """Peak resident memory since :func:`reset_peak_rss` (``VmHWM``), in GiB; ``""`` where
    /proc is not available."""
    return _status_gib("VmHWM:")


def _status_gib(key: str) -> float | str:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return ""


class MetricsLog:
    def __init__(self, run_dir: Path, console: Console | None = None) -> None:
        self.run_dir = run_dir
        self.console = console or Console()
        self.rows: list[dict[str, Any]] = []
        self.csv_path = run_dir / "metrics.csv"
        self.png_path = run_dir / "curves.png"
        run_dir.mkdir(parents=True, exist_ok=True)
        self._tb: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except Exception:  # tensorboard is optional: CSV and PNG always exist
            self._tb = None

    def log(self, row: Mapping[str, Any]) -> None:
        full = {c: row.get(c, "") for c in COLUMNS}
        self.rows.append(full)
        with self.csv_path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        if self._tb is not None:
            for key, value in full.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, int(full["step"]))
            self._tb.flush()
        if len(self.rows) == 1:
            self.console.print(FIELDS, markup=False, highlight=False)
        self.console.print(_line(full))
        self.plot()

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = self.figure()
        fig.savefig(self.png_path, dpi=80)
        plt.close(fig)

    def figure(self) -> Any:
        """The curves as a matplotlib figure, one panel per quantity (``plot`` saves it)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [("heldout_accuracy", "held-out accuracy (greedy)"),
                  ("accuracy", "train accuracy (all samples)"),
                  ("reward_mean", "shaped reward, kept samples"),
                  ("kept_group_ratio", "kept-group ratio (dynamic sampling)"),
                  ("entropy", "token entropy"),
                  ("clip_high", "clip fraction high / low"),
                  ("response_length", "response length (tokens)"),
                  ("stale_dropped", "stale dropped / cancelled samples"),
                  ("turns", "turns / tool calls per episode (train)"),
                  ("heldout_turns", "turns / tool calls per episode (held-out)"),
                  ("mismatch_kl_token", "rollout vs trainer KL: token / sequence"),
                  ("mismatch_masked", "mismatch: fraction masked / mean weight"),
                  ("peak_rss_gib", "peak RSS per step (GiB)")]
        fig, axes = plt.subplots(3, 5, figsize=(20, 10.5))
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        for ax, (key, title) in zip(axes.flat, panels, strict=False):
            xs, ys = _series(self.rows, key)
            # Markers on every series: after one step a line has one point, which a line
            # without markers does not draw at all (the panel looked empty).
            ax.plot(xs, ys, marker="o")
            if not xs:
                ax.text(0.5, 0.5, NO_DATA.get(key, "no value logged yet"), ha="center",
                        va="center", transform=ax.transAxes, fontsize=9, color="grey")
            if key == "clip_high":
                ax.plot(*_series(self.rows, "clip_low"), marker="o", label="low")
                ax.legend(["high", "low"])
            if key == "stale_dropped":
                ax.plot(*_series(self.rows, "cancelled_samples"), marker="o")
                ax.legend(["stale", "cancelled"])
            if key == "mismatch_kl_token":
                ax.plot(*_series(self.rows, "mismatch_kl_seq"), marker="o")
                ax.legend(["per token", "per sequence"])
            if key == "mismatch_masked":
                ax.plot(*_series(self.rows, "mismatch_weight_mean"), marker="o")
                ax.legend(["masked", "mean IS weight"])
            if key in ("turns", "heldout_turns"):
                calls = "tool_calls" if key == "turns" else "heldout_tool_calls"
                ax.plot(*_series(self.rows, calls), marker="o")
                ax.legend(["turns", "tool calls"])
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
        fig.tight_layout()
        return fig

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(float(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), int | float)]
    return [p[0] for p in pts], [p[1] for p in pts]


FIELDS = (
    "fields of each step line: v = policy version the step trained; acc = train accuracy (share "
    "of all the step's samples with reward 1); reward = mean shaped reward of the samples the "
    "loss saw; kept = share of groups kept by dynamic sampling (rewards not all equal); rounds "
    "= generation rounds to fill the batch; stale / cancel = samples dropped as too old / "
    "cancelled; H = mean token entropy; clip = share of tokens clipped low/high; len = mean "
    "response tokens; turns / tools = per episode; roll / train = tokens per second; t = "
    "seconds of rollout + training + weight push; rss = the process's peak memory; held-out = "
    "greedy accuracy on the held-out tasks (when evaluated). metrics.csv holds every column.")
"""The legend printed once, above the first step line."""

NO_DATA = {
    "heldout_accuracy": "held-out evaluation not run yet",
    "heldout_turns": "held-out evaluation not run yet",
    "peak_rss_gib": "not measured on this platform",
}
"""Why a panel is empty, said in the panel instead of leaving a blank box."""


def _line(row: Mapping[str, Any]) -> str:
    def f(key: str, fmt: str = ".3f") -> str:
        v = row.get(key)
        return format(v, fmt) if isinstance(v, int | float) else "-"
    held = f" [bold]held-out {f('heldout_accuracy')}[/bold]" if isinstance(
        row.get("heldout_accuracy"), int | float) else ""
    return (f"step {row['step']:>3} v{row['policy_version']} acc {f('accuracy')} "
            f"reward {f('reward_mean')} kept {f('kept_group_ratio', '.2f')} "
            f"rounds {row['generation_rounds']} stale {row['stale_dropped']} "
            f"cancel {row['cancelled_samples']} H {f('entropy')} clip {f('clip_low')}/"
            f"{f('clip_high')} len {f('response_length', '.1f')} turns {f('turns', '.2f')} "
            f"tools {f('tool_calls', '.2f')} "
            f"roll {f('rollout_tokens_per_s', '.0f')} tok/s train "
            f"{f('train_tokens_per_s', '.0f')} tok/s t {f('time_rollout_s', '.0f')}+"
            f"{f('time_train_s', '.0f')}+{f('time_push_s', '.1f')}s "
            f"rss {f('peak_rss_gib', '.2f')} GiB{held}")


def paired_bootstrap(before: Sequence[float], after: Sequence[float], *, samples: int = 10_000,
                     seed: int = 0) -> tuple[float, float, float]:
    """(mean difference, 2.5th percentile, 97.5th percentile) of ``after - before`` over the
    same tasks, resampling tasks with replacement. The tasks are the noise: the same greedy
    policy on other tasks of the same families would score differently."""
    if len(before) != len(after) or not before:
        raise ValueError("need two equally long, non-empty lists of per-task scores")
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    lo = means[math.floor(0.025 * (samples - 1))]
    hi = means[math.ceil(0.975 * (samples - 1))]
    return sum(diffs) / n, lo, hi
