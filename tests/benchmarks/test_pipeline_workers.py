"""``rollout bench pipeline --workers``: the table's rows, every job finished exactly once, and
the CPU-bound environment's work checked against an independent computation. No speed is
asserted."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest

from rollout.benchmarks import pipeline, pipeline_workers
from rollout.benchmarks.handlers import CpuHandler, lcg, lcg_jump
from rollout.benchmarks.server_process import StreamResult, job_ids
from rollout.runtime.handler import JobContext
from rollout.runtime.types import JobSpec


def test_lcg_jump_matches_stepping() -> None:
    for seed, steps in ((0, 0), (1, 1), (7, 2), (2**40 + 3, 999), (123456789, 20_000)):
        assert lcg_jump(seed, steps) == lcg(seed, steps)


async def test_cpu_environment_rewards_only_the_right_digest() -> None:
    ctx = JobContext(spec=JobSpec(job_id="job-1", environment="cpu", task={"iters": 300}))
    handler = CpuHandler()
    await handler.init(ctx)
    ctx.outcome = await handler.run(ctx)
    # Independent: the closed form from the job's seed, and the process that ran RUN.
    seed = sum(b"job-1") * 2654435761
    assert ctx.outcome.metadata["digest"] == str(lcg_jump(lcg_jump(seed, 300), 300))
    assert ctx.outcome.metadata["pid"] == str(os.getpid())
    assert (await handler.eval(ctx)).value == 1.0
    ctx.outcome.metadata["digest"] = str(lcg_jump(seed, 600) ^ 1)  # RUN's work skipped/wrong
    assert (await handler.eval(ctx)).value == 0.0
    ctx.outcome.metadata["digest"] = str(lcg_jump(seed, 600))
    ctx.state["cpu"] = 5  # another job's INIT state
    assert (await handler.eval(ctx)).value == 0.0


def test_exactly_once_fails_on_a_duplicate_or_a_lost_job() -> None:
    ids = job_ids("off", 3)
    good = StreamResult(jobs=3, finished=Counter(ids), trajectories=Counter(ids), reward_one=3)
    assert pipeline_workers.Mode(good, ids, 0.0, 0.0).ok
    dup = StreamResult(jobs=3, finished=Counter([*ids, "off1"]), trajectories=Counter(ids),
                       reward_one=3)
    lost = StreamResult(jobs=3, finished=Counter(ids[:2]), trajectories=Counter(ids[:2]),
                        reward_one=2)
    assert not pipeline_workers.Mode(dup, ids, 0.0, 0.0).ok
    assert not pipeline_workers.Mode(lost, ids, 0.0, 0.0).ok


def test_workers_flag_is_checked() -> None:
    with pytest.raises(SystemExit):
        pipeline.main(["--workers", "two"])
    with pytest.raises(SystemExit):
        pipeline.main(["--env", "cpu"])  # --env without --workers


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_workers_2_cpu_every_job_once_and_work_in_two_other_processes() -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed")
    jobs = 12
    rows = await pipeline_workers.measure_workers([2], "cpu", jobs, iters=400, slots=2,
                                                  warmup=2)
    assert [r.workers for r in rows] == [0, 2]  # the single-process baseline is always there
    server_pids = set()
    for row in rows:
        for prefix, mode in (("off", row.off), ("on", row.on)):
            ids = [f"{prefix}{k}" for k in range(jobs)]
            assert mode.result.finished == Counter(ids)
            assert mode.result.trajectories == Counter(ids)
            assert mode.result.reward_one == jobs
        assert row.off.result.events == 0 and row.on.result.events == 6 * jobs
        if row.workers == 0:
            assert row.processes == 1 and len(row.off.result.pids) == 1
            server_pids = row.off.result.pids
        else:
            # RUN ran in both agents, neither of them the server process.
            assert len(row.off.result.pids | row.on.result.pids) == 2
            assert not (row.off.result.pids | row.on.result.pids) & server_pids
            assert row.processes > 3  # front, Ray's GCS and raylet, two agents


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workers_command_prints_one_row_per_count(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("ray", reason="the `ray` extra is not installed")
    rc = pipeline.main(["--workers", "2", "--env", "noop", "--jobs", "20", "--slots", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "env noop" in out
    # The main table's rows: nine columns, so ten rules on a row line.
    rows = [line for line in out.splitlines()
            if line.count("│") == 10 and re.match(r"^│ (0 \(baseline\)|2)\s+│", line)]
    assert [line.split("│")[1].strip() for line in rows] == ["0 (baseline)", "2"], out
    assert all(line.rstrip(" │|").endswith("yes") for line in rows), out
