"""TESTING TOOL — a policy that replays scripted assistant messages. NEVER a default backend.

``ScriptedEngine`` answers each turn of a session with the next message of a script, tokenized
with the real tokenizer and followed by the end-of-turn token, exactly as a model would have
sampled it. It exists so the agent loop, the environments and the whole server can be tested
end to end (tool calls, submit, budgets, deadlines) deterministically and without a model.
Nothing in the server selects it unless the configuration names it explicitly.

What it does not do (so nobody mistakes it for a model):
- ``logprobs`` are 0.0 for every token: a scripted policy emits each token with probability 1,
  so 0.0 is the true log-probability under *this* policy, but it says nothing about any model.
- The prompt ids are ignored (only the session id and the turn index select the reply).
- ``sampling.stop`` strings are not applied; ``stop_token_ids`` and ``max_tokens`` are
  (truncation at ``max_tokens`` drops the end-of-turn token and reports ``length``).

Cut turns, as a real engine reports them: a ``timeout_s`` shorter than ``latency_s`` returns
the first half of the message with ``deadline``; :meth:`ScriptedEngine.preempt` (what a weight
swap whose drain timed out does) returns the first half with ``preempted`` and leaves the script
on that message, since the loop re-issues the turn; :meth:`ScriptedEngine.abort` returns
``abort`` with no tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.runtime.llm import GenerateRequest, GenerateResult
from rollout.server.llm.engine import Engine, EngineError

Script = Mapping[str, Sequence[str]] | Callable[[str, int], str]
"""Assistant messages per session id, or a function ``(session_id, turn_index) -> message``."""


class ScriptedEngine(Engine):
    """Replays ``scripts[session_id][turn]`` as the model's output. TESTING TOOL ONLY.

    ``latency_s`` delays every turn (cancellable through :meth:`abort`), so tests can exercise
    deadlines and cancellation. The turn index of a session counts its successful ``generate``
    calls since the session started or was released; engines that share one ``turns`` dict
    agree on it, so a session that fails over to another scripted backend continues its script.
    """

    def __init__(self, tokenizer: Any, scripts: Script, *, name: str = "scripted",
                 policy_version: int = 0, end_of_turn_id: int | None = None,
                 latency_s: float = 0.0, turns: dict[str, int] | None = None,
                 token_latency_s: float = 0.0) -> None:
        self.name = name
        self._tokenizer = tokenizer
        self._scripts = scripts
        self._version = policy_version
        eot = end_of_turn_id if end_of_turn_id is not None else tokenizer.eos_token_id
        if not isinstance(eot, int):
            raise ValueError("tokenizer has no eos_token_id; pass end_of_turn_id")
        self.end_of_turn_id = eot
        self.latency_s = latency_s
        self.token_latency_s = token_latency_s
        """With :meth:`generate_stream`: the wait before each token (a model's decode step),
        so a streamed turn's first token comes out before its last is produced."""
        self._turns: dict[str, int] = turns if turns is not None else {}
        self._aborts: dict[str, set[asyncio.Event]] = {}
        self._preempted: set[asyncio.Event] = set()
        self.requests: list[GenerateRequest] = []
        """Every request received, in order (tests inspect seeds, budgets, prompts)."""
        self.released: list[str] = []

    @classmethod
    def from_file(cls, path: str | Path, tokenizer: Any, **kwargs: Any) -> ScriptedEngine:
        """Load scripts from JSONL lines ``{"job_id": "...", "messages": ["...", ...]}``."""
        scripts: dict[str, list[str]] = {}
        for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                job_id, messages = row["job_id"], row["messages"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected "
                                 '{"job_id": str, "messages": [str, ...]}') from e
            if not isinstance(job_id, str) or not isinstance(messages, list) or not all(
                    isinstance(m, str) for m in messages):
                raise ValueError(f"{path}:{lineno}: job_id must be a string and messages a "
                                 "list of strings")
            scripts[job_id] = messages
        return cls(tokenizer, scripts, **kwargs)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def message_for(self, session_id: str, turn: int) -> str:
        if callable(self._scripts):
            return self._scripts(session_id, turn)
        if session_id not in self._scripts:
            raise EngineError(f"scripted engine has no script for session {session_id!r}")
        script = self._scripts[session_id]
        if turn >= len(script):
            raise EngineError(f"script for session {session_id!r} has only {len(script)} "
                              f"turns; turn {turn} was requested")
        return script[turn]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        sid = request.session_id
        turn = self._turns.get(sid, 0)
        message = self.message_for(sid, turn)
        self._turns[sid] = turn + 1
        aborted = asyncio.Event()
        self._aborts.setdefault(sid, set()).add(aborted)
        wait = self.latency_s
        timed_out = request.timeout_s is not None and request.timeout_s < wait
        if timed_out:
            wait = max(0.0, request.timeout_s or 0.0)
        try:
            ids = await asyncio.to_thread(self._encode, message)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # not wait_for: gh-86296 on 3.11
                        await aborted.wait()
        finally:
            self._aborts[sid].discard(aborted)
            if not self._aborts[sid]:
                del self._aborts[sid]
        half = ids[:max(1, len(ids) // 2)]
        if aborted in self._preempted:
            self._preempted.discard(aborted)
            self._turns[sid] = turn  # re-issued: the script stays on this message
            return GenerateResult(half, [0.0] * len(half), "preempted", self._version, self.name)
        if aborted.is_set():
            return GenerateResult([], [], "abort", self._version, self.name)
        if timed_out:
            return GenerateResult(half, [0.0] * len(half), "deadline", self._version, self.name)
        output, finish = self._cut([*ids, self.end_of_turn_id], request)
        return GenerateResult(output, [0.0] * len(output), finish, self._version, self.name)

    async def generate_stream(self, request: GenerateRequest,
                              ) -> AsyncGenerator[GenerateResult, None]:
        """The turn token by token, ``token_latency_s`` apart (abortable). Without a per-token
        latency, or with a deadline or a preemption to honour, the whole turn comes as one
        piece from :meth:`generate` (the cut-turn rules live there)."""
        too_slow = request.timeout_s is not None and \
            request.timeout_s < self.token_latency_s * (request.max_tokens + 1)
        if self.token_latency_s <= 0 or self.latency_s > 0 or too_slow:
            yield await self.generate(request)
            return
        self.requests.append(request)
        sid = request.session_id
        turn = self._turns.get(sid, 0)
        message = self.message_for(sid, turn)
        self._turns[sid] = turn + 1
        aborted = asyncio.Event()
        self._aborts.setdefault(sid, set()).add(aborted)
        try:
            ids = await asyncio.to_thread(self._encode, message)
            output, finish = self._cut([*ids, self.end_of_turn_id], request)
            for i, token in enumerate(output):
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.token_latency_s):
                        await aborted.wait()
                if aborted.is_set():
                    yield GenerateResult([], [], "abort", self._version, self.name)
                    return
                last = i == len(output) - 1
                yield GenerateResult([token], [0.0], finish if last else "", self._version,
                                     self.name)
        finally:
            self._aborts[sid].discard(aborted)
            if not self._aborts[sid]:
                del self._aborts[sid]

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def _cut(self, ids: list[int], request: GenerateRequest) -> tuple[list[int], str]:
        stops = {self.end_of_turn_id, *request.sampling.stop_token_ids}
        for i, t in enumerate(ids):
            if i >= request.max_tokens:
                return ids[:i], "length"
            if t in stops:
                return ids[:i + 1], "stop"
        return ids, "stop"

    async def abort(self, session_id: str) -> None:
        """Make the session's in-flight turn return ``abort`` now."""
        for event in self._aborts.get(session_id, ()):
            event.set()

    async def preempt(self, session_id: str) -> None:
        """Cut the session's in-flight turn as a weight swap would (``preempted``)."""
        for event in self._aborts.get(session_id, ()):
            self._preempted.add(event)
            event.set()

    def in_flight(self, session_id: str) -> bool:
        return bool(self._aborts.get(session_id))

    async def release_session(self, session_id: str) -> None:
        self._turns.pop(session_id, None)
        self.released.append(session_id)

    async def health(self) -> bool:
        return True

    async def update_weights(self, source: Any, version: int) -> None:
        """No weights to load; only the reported policy version changes."""
        self._version = version
