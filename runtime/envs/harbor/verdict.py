"""The reward a Harbor verifier wrote, read as Harbor reads it.

``tests/test.sh`` writes ``/logs/verifier/reward.json`` (an object of named numbers) or
``/logs/verifier/reward.txt`` (one number). As in Harbor, ``reward.json`` wins when both exist;
its ``reward`` entry is the reward (else its first entry) and every entry becomes a named
component. Values need not be 0 or 1 (partial credit), but must be finite numbers.

Nothing here can fail a job: a verifier that wrote no reward, or one that cannot be read, is a
reward of 0 with the reason, since the policy's changes to the environment (a deleted
interpreter, a filled disk) can make the verifier fail. ``rollout tasks check-harbor`` is how a
task's own broken verifier is found.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

REWARD_TXT = "reward.txt"
REWARD_JSON = "reward.json"
MAX_REWARD_FILE = 64 << 10
MAX_COMPONENTS = 64


@dataclass(frozen=True)
class Verdict:
    """What the verifier's files say: the reward, its named parts, and why it is 0 when the
    files said nothing usable."""

    value: float
    components: dict[str, float] = field(default_factory=dict)
    source: str = ""
    """``reward.json`` / ``reward.txt`` / '' when neither gave a reward."""
    problem: str = ""


def read(files: dict[str, bytes | None]) -> Verdict:
    """The verdict of the verifier's output folder: ``files`` maps ``reward.json`` and
    ``reward.txt`` to their bytes (None when absent)."""
    raw_json = files.get(REWARD_JSON)
    if raw_json is not None:
        return _from_json(raw_json)
    raw_txt = files.get(REWARD_TXT)
    if raw_txt is not None:
        return _from_txt(raw_txt)
    return Verdict(0.0, problem="the verifier wrote neither /logs/verifier/reward.txt nor "
                                "reward.json")


def _from_txt(raw: bytes) -> Verdict:
    text = raw[:MAX_REWARD_FILE].decode("utf-8", "replace").strip()
    if not text:
        return Verdict(0.0, source=REWARD_TXT, problem="reward.txt is empty")
    try:
        value = float(text)
    except ValueError:
        return Verdict(0.0, source=REWARD_TXT,
                       problem=f"reward.txt is not a number: {text[:80]!r}")
    if not math.isfinite(value):
        return Verdict(0.0, source=REWARD_TXT, problem=f"reward.txt is not finite: {text!r}")
    return Verdict(value, {"reward": value}, REWARD_TXT)


def _from_json(raw: bytes) -> Verdict:
    if len(raw) > MAX_REWARD_FILE:
        return Verdict(0.0, source=REWARD_JSON,
                       problem=f"reward.json is over {MAX_REWARD_FILE} bytes")
    try:
        data: Any = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return Verdict(0.0, source=REWARD_JSON, problem=f"reward.json is not JSON: {e}")
    except RecursionError:  # what the verifier wrote is the task's (or the agent's) doing
        return Verdict(0.0, source=REWARD_JSON,
                       problem="reward.json nests JSON too deeply to read")
    if not isinstance(data, dict) or not data:
        return Verdict(0.0, source=REWARD_JSON,
                       problem="reward.json must be a non-empty object of named numbers")
    if len(data) > MAX_COMPONENTS:
        return Verdict(0.0, source=REWARD_JSON,
                       problem=f"reward.json has {len(data)} entries, over {MAX_COMPONENTS}")
    components: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(
                value):
            return Verdict(0.0, source=REWARD_JSON,
                           problem=f"reward.json entry {key[:80]!r} is not a finite number: "
                                   f"{str(value)[:80]!r}")
        components[str(key)[:128]] = float(value)
    value = components.get("reward", next(iter(components.values())))
    return Verdict(value, components, REWARD_JSON)
