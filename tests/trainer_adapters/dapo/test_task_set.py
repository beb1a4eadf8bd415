"""The shipped DAPO task set and the ``short`` environment's scoring."""

from __future__ import annotations

import json

import pytest

from rollout.runtime.envs.short.handler import ShortAnswerHandler, names, score
from rollout.runtime.types import InvalidArgument
from rollout.trainer_adapters.dapo import task_set


def rows(path: object) -> list[dict]:
    return [json.loads(line) for line in open(path)]  # type: ignore[call-overload]


def test_shipped_files_are_what_the_generator_writes(tmp_path, monkeypatch) -> None:
    shipped = {"train.jsonl": task_set.TRAIN_FILE, "heldout.jsonl": task_set.HELDOUT_FILE}
    monkeypatch.setattr(task_set, "DATA_DIR", tmp_path)
    monkeypatch.setattr(task_set, "TRAIN_FILE", tmp_path / "train.jsonl")
    monkeypatch.setattr(task_set, "HELDOUT_FILE", tmp_path / "heldout.jsonl")
    task_set.main([])
    for name, path in shipped.items():
        assert (tmp_path / name).read_text() == path.read_text()


def test_train_and_heldout_share_no_question_and_every_task_is_valid() -> None:
    train, heldout = rows(task_set.TRAIN_FILE), rows(task_set.HELDOUT_FILE)
    assert not {r["task"]["question"] for r in train} & {r["task"]["question"] for r in heldout}
    handler = ShortAnswerHandler()
    for row in train + heldout:
        assert row["environment"] == "short"
        handler.validate_task(row["task"])
        assert score(row["task"]["answer"], row["task"]["answer"],
                     row["task"]["distractors"])["correct"] == 1.0
    families = {r["metadata"]["family"] for r in heldout}
    assert families == set(task_set.FAMILIES)


@pytest.mark.parametrize("reply,correct", [
    ("70", 1.0), ("The larger number is 70.", 1.0), ("\\boxed{70}", 1.0), ("70.0", 1.0),
    ("70 is larger than 67", 0.0),  # hedging: names the distractor too
    ("67", 0.0), ("170", 0.0), ("", 0.0), ("I think \\boxed{67} but maybe 70", 0.0),
])
def test_score_names_the_answer_and_no_distractor(reply: str, correct: float) -> None:
    assert score(reply, "70", ["67"])["correct"] == correct


def test_words_match_whole_words_only() -> None:
    assert names("A cat.", "cat") and names("CAT", "cat")
    assert not names("concatenate", "cat") and not names("cats", "cat")


def test_bad_tasks_are_rejected_with_the_field() -> None:
    handler = ShortAnswerHandler()
    with pytest.raises(InvalidArgument) as info:
        handler.validate_task({"question": "q", "answer": "a", "distractors": "b"})
    assert info.value.field == "task.distractors"
    with pytest.raises(InvalidArgument, match="never be solved"):
        handler.validate_task({"question": "q", "answer": "a", "distractors": ["A"]})
    with pytest.raises(InvalidArgument) as info:
        handler.validate_task({"answer": "a"})
    assert info.value.field == "task.question"
