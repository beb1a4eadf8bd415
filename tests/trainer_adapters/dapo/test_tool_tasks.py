"""The shipped ``tools`` task set (multi-turn, python tool) and the configs that train on it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollout.runtime.envs.math.handler import MathHandler
from rollout.trainer_adapters.dapo import tool_tasks
from rollout.trainer_adapters.dapo.run_config import load_config
from rollout.trainer_adapters.dapo.trainer import episode_budget

DAPO = Path(tool_tasks.__file__).resolve().parent


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def worked_answer(family: str, question: str) -> int:
    """The answer computed from the question's own numbers, family by family."""
    n = [int(x) for x in re.findall(r"\d+", question)]
    return {"product": lambda: n[0] * n[1] * n[2], "cubed": lambda: n[0] ** 3,
            "remainder": lambda: n[0] % n[1], "total": lambda: sum(n),
            "crates": lambda: n[0] * n[1], "tank": lambda: n[0] - n[1] - n[2]}[family]()


def test_shipped_files_are_what_the_generator_writes(tmp_path, monkeypatch) -> None:
    shipped = {"tools_train.jsonl": tool_tasks.TRAIN_FILE,
               "tools_heldout.jsonl": tool_tasks.HELDOUT_FILE}
    monkeypatch.setattr(tool_tasks, "DATA_DIR", tmp_path)
    monkeypatch.setattr(tool_tasks, "TRAIN_FILE", tmp_path / "tools_train.jsonl")
    monkeypatch.setattr(tool_tasks, "HELDOUT_FILE", tmp_path / "tools_heldout.jsonl")
    tool_tasks.main([])
    for name, path in shipped.items():
        assert (tmp_path / name).read_text() == path.read_text()


def test_tasks_are_valid_math_jobs_with_the_right_answers_and_no_overlap() -> None:
    train, heldout = rows(tool_tasks.TRAIN_FILE), rows(tool_tasks.HELDOUT_FILE)
    assert not {r["task"]["question"] for r in train} & {r["task"]["question"] for r in heldout}
    handler = MathHandler()
    for row in train + heldout:
        assert row["environment"] == "math" and row["task"]["tools"] == ["python"]
        handler.validate_task(row["task"])
        family = row["metadata"]["family"]
        assert row["task"]["answer"] == str(worked_answer(family, row["task"]["question"]))
    # The held-out limit of the CPU config takes 8 of every family.
    first = [r["metadata"]["family"] for r in heldout[:48]]
    assert {f: first.count(f) for f in set(first)} == dict.fromkeys(tool_tasks.FAMILIES, 8)


@pytest.mark.parametrize("name", ["smollm2_tools_cpu.toml", "smollm2_tools_gpu.toml"])
def test_tool_configs_name_the_shipped_data_from_any_directory(name, tmp_path, monkeypatch
                                                               ) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(DAPO / name)
    assert Path(cfg.data.train) == tool_tasks.TRAIN_FILE
    assert Path(cfg.data.heldout) == tool_tasks.HELDOUT_FILE
    assert cfg.rollout.max_turns >= 2  # code, then read its output and answer
    # The overlong ramp sits at the end of the episode's budget, not of one turn.
    assert episode_budget(cfg) == cfg.rollout.max_tokens * cfg.rollout.max_turns
    assert cfg.algo.overlong_cache < cfg.rollout.max_tokens * (cfg.rollout.max_turns - 1)
