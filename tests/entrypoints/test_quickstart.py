"""`rollout quickstart`: its batch, and what a finished run must show (the run itself is the
README's command, run as written by tests/test_doc_commands.py)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
from google.protobuf import json_format

from rollout.entrypoints import quickstart
from rollout.entrypoints.quickstart import MIX, SEED_STRIDE, build_specs, quickstart_tasks


def check_quickstart_run(text: str, stderr: str, out: Path, mix: dict[str, int]) -> None:
    """What a finished ``rollout quickstart`` must show: its printed seed reaching every job,
    the summary agreeing with the trajectories, SmolLM2's own tokens, an agent at work, and a
    quiet output. Called by the test that runs the README's quickstart command as written
    (tests/test_doc_commands.py): one run of the real model covers both."""
    said = re.search(r"^seed (\d+) \(run again with --seed \1 ", text, re.M)
    assert said, text[:3000]
    seed = int(said.group(1))
    for heading in ("rollout summary", "how runs ended"):
        assert heading in text, text[-3000:]
    trajs = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    prefixes = {"math": "math-", "code": "code-", "swe": "rollout__"}
    assert len(trajs) == sum(mix.values())
    for env, count in mix.items():
        assert sum(prefixes[env] in t["job_id"] for t in trajs) == count, (env, count)
    # The seed reaches every job: job i samples from seed + i * stride (the trajectory says so).
    assert sorted(int(t["seed"]) for t in trajs) == [seed + i * SEED_STRIDE
                                                     for i in range(len(trajs))]
    # On a loaded machine a job may reach its RUN deadline before its first token: then the
    # summary must say so, in one line for its environment.
    for t in trajs:
        if t["turns"]:
            continue
        assert t["termination_reason"] == "TERMINATION_REASON_DEADLINE", t
        env = next(e for e, p in prefixes.items() if p in t["job_id"])
        assert re.search(rf"^{env}: \d+ of \d+ jobs reached the RUN deadline before the model",
                         text, re.M), text[-3000:]
    for t in trajs:
        if not t["turns"]:
            continue
        turn = t["turns"][0]
        assert turn["output_ids"], "SmolLM2 generated tokens"
        assert len(turn["output_logprobs"]) == len(turn["output_ids"])
        assert turn["backend"].startswith("transformers")
    # A quiet run: no warning of ours (or of a library we call) in its output.
    noisy = [line for line in (text + stderr).splitlines()
             if re.search(r"Warning\b|warnings\.warn|DeprecationWarning", line)]
    assert not noisy, noisy
    # The summary's per-environment outcome rows agree with the trajectories themselves.
    for env, prefix in prefixes.items():
        mine = [t for t in trajs if prefix in t["job_id"]]
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == [env])
        deadline = sum(t["termination_reason"] == "TERMINATION_REASON_DEADLINE" for t in mine)
        solved = sum(t["reward"] >= 1.0 and t["state"] == "STATE_SUCCEEDED" for t in mine)
        tools = sum(any(turn.get("tool_calls") for turn in t["turns"]) for t in mine)
        assert row[1] == str(len(mine)) and row[3] == str(deadline), row
        assert row[6] == str(solved) and row[9] == str(tools), row
        if solved < len(mine):
            assert re.search(rf"^{env}: (no job earned a reward|\d+ of \d+ jobs earned 0)",
                             text, re.M), text[-3000:]
    # An agent at work: the easy math tasks are solved with a python call in all but a few of
    # SmolLM2's samples (measured 16 of 16 on the first three), so no tool call in any math
    # job means the prompting or the fenced-block parsing broke.
    math_jobs = [t for t in trajs if "math-" in t["job_id"] and t["turns"]]
    if math_jobs:  # (none when the machine was too busy for any turn: said above)
        assert any(turn.get("tool_calls") for t in math_jobs for turn in t["turns"]), math_jobs
    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "state" / "jobs.sqlite3").exists(), "its own state dir, under --out-dir"


def test_quickstart_batch_is_seeded_and_uses_the_easy_sets() -> None:
    specs = build_specs({"math": 3, "code": 1}, "t", seed=5)
    assert [s.sampling.seed for s in specs] == [5 + i * SEED_STRIDE for i in range(4)]
    assert len({s.job_id for s in specs}) == 4
    shipped = (Path(__file__).resolve().parents[2] / "runtime" / "envs" / "data"
               / "quickstart-math.jsonl")
    first = json.loads(shipped.read_text().splitlines()[0])["task"]
    assert json_format.MessageToDict(specs[0].task) == first
    assert quickstart_tasks("math")[0] == first


def test_the_flags_reach_the_run(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``--mix``, ``--seed`` and ``--out-dir`` as the run receives them (the run with the
    defaults is the README's command; the seed's effect is the test above)."""
    seen: list[argparse.Namespace] = []

    async def run(args: argparse.Namespace, console: object) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(quickstart, "run", run)
    assert quickstart.main(["--mix", "math=2,code=1,swe=1", "--seed", "77",
                            "--out-dir", "elsewhere"]) == 0
    assert seen[0].mix == {"math": 2, "code": 1, "swe": 1}
    assert seen[0].seed == 77 and seen[0].out_dir == "elsewhere"
    assert quickstart.main([]) == 0 and seen[1].mix == MIX and seen[1].seed is None
    with pytest.raises(SystemExit) as exit_:
        quickstart.main(["--mix", "math2"])
    assert exit_.value.code == 2
    assert "--mix wants ENV=N,…; got 'math2'" in capsys.readouterr().err
