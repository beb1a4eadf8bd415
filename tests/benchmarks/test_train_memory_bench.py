"""``rollout bench train-memory`` runs end to end on the tiny model and tiny shapes: every
configuration in its own process, a row each, parameters compared; a process over the cap is
killed and said so."""

from __future__ import annotations

import pytest

from rollout.benchmarks import train_memory

pytestmark = pytest.mark.timeout(900)

TINY = ["--model", "tiny", "--tiny-vocab", "512", "--groups", "1", "--samples", "2",
        "--turns", "2", "--turn-tokens", "4", "--prompt", "8", "--tool-tokens", "3",
        "--micro-batch-size", "1", "--threads", "1"]

SAVINGS = {"baseline": "none", "chunk": "chunk 1024", "fused": "fused", "none": "set_to_none",
           "mmap": "mmap", "shipped": "chunk 1024, fused, set_to_none, mmap"}
"""What each configuration's row must say is on."""


def _cells(out: str, name: str) -> list[str]:
    line = next(line for line in out.splitlines() if f"│ {name}" in line)
    return [c.strip() for c in line.split("│")[1:-1]]


@pytest.mark.slow
def test_every_configuration_gets_a_row_with_its_memory_and_the_same_parameters(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert train_memory.main([*TINY, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "load average" in out
    for key, (name, _) in train_memory.CONFIGS.items():
        cells = _cells(out, name)
        assert cells[1] == SAVINGS[key], (key, cells)  # as the child's policy had them
        peak, after_load, step_peaks = float(cells[2]), float(cells[3]), cells[4].split(" / ")
        assert peak >= after_load > 0, (key, cells)
        assert len(step_peaks) == 2 and len(cells[6].split(" / ")) == 2, (key, cells)
        if key == "baseline":
            assert cells[-1] == "-"
        else:  # compared with the baseline, within 1% of lr
            assert float(cells[-1]) <= 0.01 * 2e-5, (key, cells)
    assert "parameters agree with baseline" in out


def test_a_configuration_over_the_cap_is_killed_and_fails_the_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 0.05 GiB: less than the interpreter with torch imported.
    assert train_memory.main([*TINY, "--steps", "1", "--configs", "baseline",
                              "--cap-gib", "0.05"]) == 1
    out = capsys.readouterr().out
    assert "killed at" in out and "(cap 0.05)" in out
    assert _cells(out, "baseline (no savings)")[-1].startswith("killed at")
