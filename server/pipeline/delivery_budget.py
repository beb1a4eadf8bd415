"""How much memory undelivered trajectories may take, across every session and per session.

Why it exists: a delivery is durable in the store before it is announced, so a session never
*needs* to hold one in memory until it can be written to its client. Without a bound, a client
that stops reading (or reads slowly) makes the server keep every trajectory that finished for
it meanwhile (up to ``max_unacked`` of them, each as decoded Python objects): with long
trajectories a few stalled sessions take gigabytes. With the budget, a session takes a delivery
into memory only while its own bytes stay under its share and everyone's under the total;
otherwise the delivery stays in the store and the session pages it in once what it holds has
been written to its client (Pub/Sub StreamingPull's ``max_outstanding_bytes``, server side).

What counts: a trajectory from the moment a subscription queues it (live, or paged in from the
store) until the servicer has written its frame to the client's stream (or the session ends).
A frame that gRPC is still writing to a client that stopped reading is counted until its write
completes, so a stalled session holds at most its share.

The unit is an estimate of the decoded trajectory's memory (:func:`held_bytes`), not its
encoded size: as Python objects a token id costs about 36 bytes and a log-probability 32,
roughly ten times their protobuf encoding, and it is the objects that take the memory.

Rules, in order (:meth:`DeliveryBudget.refusal`):
- a session holding nothing may take one delivery of any size while the total has room for
  it, or while nothing at all is held (a trajectory larger than the whole budget is still
  delivered, alone);
- otherwise a delivery is taken only if the session stays within ``session_bytes`` and the
  total within ``total_bytes``.
The total therefore never passes ``total_bytes`` except by one delivery larger than the budget
itself. A session refused for want of total room is woken when any session releases bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollout.runtime.types import Trajectory

TOKEN_BYTES = 36
"""A token id in a Python list: an 8-byte pointer and a 28-byte int (ids above 256 are not
the interpreter's cached small ints)."""
LOGPROB_BYTES = 32
"""A log-probability in a Python list: an 8-byte pointer and a 24-byte float."""
TURN_BYTES = 1280
"""A turn's own objects (dataclass, four lists, strings), before its tokens."""
TRAJECTORY_BYTES = 4096
"""A trajectory's own objects (timings, metadata, labels), before its turns."""


def held_bytes(t: Trajectory) -> int:
    """Estimated memory of a decoded trajectory (see the module docstring)."""
    total = TRAJECTORY_BYTES + 128 * (len(t.metadata) + len(t.labels))
    for turn in t.turns:
        tokens = len(turn.prompt_ids) + len(turn.output_ids) + len(turn.observation_ids)
        total += TURN_BYTES + TOKEN_BYTES * tokens + LOGPROB_BYTES * len(turn.output_logprobs)
    return total


@dataclass
class BudgetStats:
    """What the metrics show."""

    held: int
    """Bytes of undelivered trajectories in memory now, all sessions together."""
    total_bytes: int
    session_bytes: int
    peak: int
    """Highest ``held`` since the server started."""


class DeliveryBudget:
    """One server's budget; each subscription keeps its own count and asks here."""

    def __init__(self, total_bytes: int, session_bytes: int) -> None:
        if total_bytes < 1 or session_bytes < 1:
            raise ValueError("pipeline.delivery_memory_bytes and session_memory_bytes must be "
                             "at least 1")
        self.total_bytes = total_bytes
        self.session_bytes = min(session_bytes, total_bytes)
        self.held = 0
        self.peak = 0
        self._waiting: dict[int, Callable[[], None]] = {}
        """Subscriptions refused for want of total room, by id: woken on any release."""

    def refusal(self, session_held: int, size: int) -> str:
        """Why a session holding ``session_held`` bytes may not take ``size`` more: "" (it
        may), "session" (its share is full: only its own writes make room) or "total"."""
        if self.held == 0:
            return ""
        if self.held + size > self.total_bytes:
            return "total"
        if session_held and session_held + size > self.session_bytes:
            return "session"
        return ""

    def charge(self, size: int) -> None:
        self.held += size
        self.peak = max(self.peak, self.held)

    def release(self, size: int) -> None:
        self.held = max(0, self.held - size)
        if self._waiting and size:
            waiting, self._waiting = self._waiting, {}
            for wake in waiting.values():
                wake()

    def wait_for_room(self, key: int, wake: Callable[[], None]) -> None:
        """Call ``wake`` once at the next release (a session refused for the total)."""
        self._waiting[key] = wake

    def forget(self, key: int) -> None:
        self._waiting.pop(key, None)

    def stats(self) -> BudgetStats:
        return BudgetStats(self.held, self.total_bytes, self.session_bytes, self.peak)
