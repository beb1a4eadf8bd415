"""Token accounting for multi-turn chats: the model's output ids are never re-tokenized.

The prompt of turn k+1 is exactly ``prompt(k) + output_ids(k) + delta(k)``, where ``delta(k)``
holds the tokens of the *new* messages only (tool observations, user messages) plus the
generation prompt that opens the next assistant turn. Re-rendering the whole conversation and
re-tokenizing it instead would silently change the ids the model actually sampled (BPE has many
spellings of one string, and ``decode(encode(x)) != x`` for some ids), so the trainer would
compute log-probabilities of tokens the policy never produced.

How a delta is computed: the conversation is rendered with the chat template, with the
previous assistant message's content replaced by a sentinel string, and everything the template
writes *after* the sentinel is taken: the assistant turn's closing (``<|im_end|>\\n`` in ChatML),
the new messages, and the generation prompt. That text is tokenized on its own. Whatever prefix
of the closing the model already emitted (it usually stops *on* ``<|im_end|>``) is dropped; the
rest (the ``\\n`` after it, or the whole closing when the model ran out of tokens mid-sentence)
is appended as prompt tokens with loss mask 0. This works whether or not the template is
append-only; whether it is (rendering the history then the new messages gives a prefix of
rendering everything) is detected and reported, never papered over by re-tokenizing.

How much is rendered for a delta: the text after the sentinel is, for ordinary templates, the
same whether the whole history is rendered or only its head and its last few messages, the
generation prompt is one fixed text appended, and the closing is one fixed text. Those three
properties are what let a delta render a few messages once instead of the whole conversation
three times; none is assumed. :func:`probe_render_plan` renders a set of probe conversations
both ways once per tokenizer, template, template arguments and tools list, and a
:class:`RenderPlan` takes each shortcut only where every probe gave the full render's text;
anything else renders the whole conversation as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Message = Mapping[str, Any]

_SENTINEL = "ROLLOUT_ASSISTANT_SENTINEL_5f0c2e"
"""Stands in for the assistant's content; chosen so no template trims or escapes it."""
_TOOL_SENTINEL = "ROLLOUT_TOOL_SENTINEL_9b41d7"
"""Content of the probe tool message that tells whether a template renders a tool role."""
_MEMO_MAX_CHARS = 64
"""Fragments this short (generation prompts, closings) are memoized by ``encode``."""
_MEMO_MAX_ENTRIES = 256
_HEAD = 2
"""Leading history messages a windowed render keeps: templates treat the first message (a
system prompt, a default one when absent) and the first user message (Llama 3.1 puts the
tools there) specially."""
_TAIL = 2
"""Trailing history messages a windowed render keeps at least: templates look at the
message before the one they render (Qwen groups consecutive tool results)."""
_PLANS_PER_TOKENIZER = 64


class ChatTemplateError(ValueError):
    """The chat template cannot be used for incremental rendering (say why)."""


_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()
_fallback_lock = threading.Lock()


def _lock_for(tokenizer: Any) -> threading.Lock:
    # HF fast tokenizers raise "Already borrowed" when two threads use one instance at once;
    # jobs share the served tokenizer and tokenize off the event loop in worker threads.
    with _locks_guard:
        try:
            return _locks.setdefault(tokenizer, threading.Lock())
        except TypeError:  # not weak-referenceable: one lock per process is still correct
            return _fallback_lock


@dataclass(frozen=True)
class RenderPlan:
    """Which shortcuts a delta may take for one template, its arguments and one tools list.

    Decided once by :func:`probe_render_plan`: each field is set only where every probe
    conversation rendered to the same text with the shortcut as without it, and ``refused``
    says why a shortcut was not taken. The default (all None) renders the whole conversation
    for every part of a delta, as the ledger always could.
    """

    window: bool = False
    """Render only the history's head and tail (:meth:`context`) before the new messages."""
    generation_prompt: str | None = None
    """The text ``add_generation_prompt`` appends, the same after every conversation; None:
    render the conversation with it on to find it."""
    closing: str | None = None
    """What follows an assistant message's content that ends the chat, the same after every
    history; None: render it."""
    refused: tuple[str, ...] = ()

    def context(self, history: Sequence[Message]) -> list[Message]:
        """The history a delta renders: all of it, or with a windowed plan its first
        ``_HEAD`` and its last ``_TAIL`` (or one more) messages; an even number is dropped
        from the middle, so every kept message keeps the parity of its position (templates
        that check roles alternate use it)."""
        if not self.window:
            return list(history)
        dropped = max(0, len(history) - _HEAD - _TAIL)
        dropped -= dropped % 2
        return [*history[:_HEAD], *history[_HEAD + dropped:]]


FULL_RENDER = RenderPlan(refused=("incremental rendering is off",))
"""A plan without shortcuts (``ChatTokenizer(incremental=False)``: the reference)."""

_plans: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, str], RenderPlan]] = (
    weakref.WeakKeyDictionary())
_plans_guard = threading.Lock()
_backends: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
"""Per tokenizer: whether its Rust backend may be called directly (``_find_backend``)."""


@dataclass(frozen=True)
class Delta:
    """The tokens appended after one assistant turn's raw output ids."""

    observation_ids: list[int]
    """Closing of the assistant turn that the model did not emit itself, then the new messages
    (loss mask 0; goes to ``Turn.observation_ids``)."""
    prompt_ids: list[int]
    """The generation prompt of the next assistant turn (goes to the next ``Turn.prompt_ids``)."""
    closing_ids: list[int]
    """The part of ``observation_ids`` that closes the previous assistant turn (diagnostic)."""
    append_only: bool
    """Whether the template rendered the history unchanged when the new messages were added."""


class ChatTokenizer:
    """Renders chat messages to token ids with a Hugging Face tokenizer and its chat template.

    Stateless apart from the tokenizer: :class:`ChatLedger` keeps one conversation's state.
    ``tools`` (OpenAI-style schemas) are passed to templates that render tools themselves.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None,
                 template_kwargs: Mapping[str, Any] | None = None,
                 incremental: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = dict(template_kwargs or {})
        self.incremental = incremental
        """Take the shortcuts a probe proved (:class:`RenderPlan`); False renders every delta
        from the whole conversation (the reference the shortcuts are tested against)."""
        self._lock = _lock_for(tokenizer)
        self._anchor_text, self._anchor_ids = self._find_anchor()
        self._backend = self._find_backend()
        self._encoded: dict[str, tuple[int, ...]] = {}

    @property
    def template_source(self) -> str:
        return str(self.chat_template or getattr(self.tokenizer, "chat_template", "") or "")

    @property
    def supports_tools(self) -> bool:
        """True when the template renders a ``tools`` argument itself (Qwen, Hermes, Llama 3)."""
        return "tools" in self.template_source

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        with self._lock:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, **kwargs)
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered fragment, tokenized as it would be after a special token.

        Fragments start mid-conversation; SentencePiece tokenizers would otherwise prepend a
        word-boundary space to the first piece. The template writes its own BOS, so none is
        added here.
        """
        if not text:
            return []
        # Every delta encodes the same few short fragments again (the generation prompt, the
        # turn's closing); encoding is a pure function of the text, so a memo stays exact.
        memo = self._encoded.get(text)
        if memo is not None:
            return list(memo)
        ids = self._encode_uncached(text)
        if len(text) <= _MEMO_MAX_CHARS:
            if len(self._encoded) >= _MEMO_MAX_ENTRIES:
                self._encoded.clear()
            self._encoded[text] = tuple(ids)
        return ids

    def _encode_uncached(self, text: str) -> list[int]:
        with self._lock:
            ids = self._encode_raw(self._anchor_text + text)
        n = len(self._anchor_ids)
        if n and ids[:n] == self._anchor_ids:
            return ids[n:]
        with self._lock:
            return self._encode_raw(text)

    def _encode_raw(self, text: str) -> list[int]:
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None \
                and backend.encode_special_tokens == bool(
                    getattr(self.tokenizer, "split_special_tokens", False)):
            return list(backend.encode_batch_fast([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _find_backend(self) -> Any:
        """The Rust tokenizer under a transformers fast tokenizer, called directly (without
        offsets) where that is all the tokenizer's ``encode`` does; else None. Decided once
        per tokenizer object (each job makes its own ChatTokenizer of the served one).

        transformers' generic fast tokenizer encodes a text by setting the backend's
        truncation and padding (off, here) and its special-token splitting, then calling the
        backend; its Python wrapping costs as much again as a short encode. So the backend is
        called directly only for that generic class (no subclass that changes how text is
        encoded or decoded), only while the backend's state is what ``encode`` would leave it
        in (checked on every call), and only if it gives the wrapper's ids (and, where the
        wrapper cleans up no spaces, its decoded texts) on probe texts. :meth:`decode` calls
        the backend directly under the same decision while the clean-up stays off."""
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # another transformers: its wrapper is used as it is
            return None
        tok = self.tokenizer
        try:
            known = _backends.get(tok)
        except TypeError:  # not weak-referenceable: decided for this instance only
            known = None
        if known is not None:
            return getattr(tok, "_tokenizer", None) if known else None
        backend = self._check_backend(tok, PreTrainedTokenizerBase, TokenizersBackend)
        with contextlib.suppress(TypeError):
            _backends[tok] = backend is not None
        return backend

    def _check_backend(self, tok: Any, base: Any, generic: Any) -> Any:
        backend = getattr(tok, "_tokenizer", None)
        kind = type(tok)
        if not isinstance(tok, generic) or backend is None \
                or not hasattr(backend, "encode_batch_fast") \
                or kind.encode is not base.encode or kind._encode_plus is not generic._encode_plus \
                or kind.decode is not base.decode or kind._decode is not generic._decode:
            return None
        specials = "".join(str(t) for t in getattr(tok, "all_special_tokens", ()) or ())
        with self._lock:
            for text in (*_PROBE_TEXTS, specials, " a  b\t\n\n c", "héllo 日本 🙂 123456",
                         f"{specials} x{specials}\n", "word " * 300):
                want = list(tok.encode(text, add_special_tokens=False))
                if backend.truncation is not None or backend.padding is not None or list(
                        backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
                ) != want or (not getattr(tok, "clean_up_tokenization_spaces", True) and str(
                        backend.decode(want, skip_special_tokens=False)) != str(
                        tok.decode(want, skip_special_tokens=False))):
                    return None
        return backend

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ids with special tokens kept (for parsing and logs; never authoritative)."""
        backend = self._backend
        # The generic wrapper's decode is the backend's, then an optional clean-up of spaces;
        # with the clean-up off the backend gives its text without the wrapper's cost.
        direct = backend is not None and not getattr(
            self.tokenizer, "clean_up_tokenization_spaces", True)
        with self._lock:
            if direct:
                return str(backend.decode(list(ids), skip_special_tokens=False))
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def initial_prompt(self, messages: Sequence[Message],
                       tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """Ids of the first prompt: system, task, and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def closing_ids(self, history: Sequence[Message],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """What the template writes after an assistant message's content that ends the chat."""
        text = self.render([*history, {"role": "assistant", "content": _SENTINEL}],
                           add_generation_prompt=False, tools=tools)
        return self.encode(_after_sentinel(text))

    @functools.cached_property
    def observation_role(self) -> str:
        """``tool`` when the template renders a tool message's content, else ``user``.

        Some templates have no tool role: Gemma's raises ("roles must alternate"), others drop
        messages of roles they do not know, so the model would never see the observation.
        Rendering a probe conversation catches both; ``user`` is the role every template takes.
        """
        chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                {"role": "tool", "name": "probe", "content": _TOOL_SENTINEL}]
        # With and without a system message: some templates refuse the system role itself,
        # which says nothing about the tool role.
        for probe in ([{"role": "system", "content": "s"}, *chat], chat):
            try:
                text = self.render(probe, add_generation_prompt=True)
            except Exception:  # jinja2 TemplateError, raise_exception(...), template bugs
                continue
            if _TOOL_SENTINEL in text:
                return "tool"
        return "user"

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "all_special_ids", None) or ())

    @functools.cached_property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn: the EOS and the closing's first special token."""
        out: set[int] = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            out.add(eos)
        closing = self.closing_ids([{"role": "system", "content": "s"},
                                    {"role": "user", "content": "u"}])
        if closing and closing[0] in self.special_ids:
            out.add(closing[0])
        return frozenset(out)

    def render_plan(self, tools: Sequence[Mapping[str, Any]] | None = None) -> RenderPlan:
        """The shortcuts deltas may take with ``tools``: probed on first use (a few dozen
        renders), then cached per tokenizer, template, template arguments and tools."""
        if not self.incremental:
            return FULL_RENDER
        plan = self.known_render_plan(tools)
        if plan is None:
            plan = probe_render_plan(self, tools)
            with _plans_guard:
                table = self._plan_table()
                if len(table) >= _PLANS_PER_TOKENIZER:
                    table.clear()
                table[self._plan_key(tools)] = plan
        return plan

    def known_render_plan(self, tools: Sequence[Mapping[str, Any]] | None = None,
                          ) -> RenderPlan | None:
        """The plan for ``tools`` if it is probed already (None: the next delta probes)."""
        if not self.incremental:
            return FULL_RENDER
        with _plans_guard:
            return self._plan_table().get(self._plan_key(tools))

    def _plan_table(self) -> dict[tuple[str, str, str], RenderPlan]:
        try:
            return _plans.setdefault(self.tokenizer, {})
        except TypeError:  # not weak-referenceable: keep this instance's own table
            return self.__dict__.setdefault("_own_plans", {})

    def _plan_key(self, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, str, str]:
        return (self.template_source,
                json.dumps(self.template_kwargs, sort_keys=True, default=repr),
                json.dumps(list(tools or ()), sort_keys=True, default=repr))

    def delta(self, history: Sequence[Message], output_ids: Sequence[int],
              new_messages: Sequence[Message], *, assistant_text: str | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None,
              add_generation_prompt: bool = True, check_append_only: bool = True,
              plan: RenderPlan | None = None) -> Delta:
        """Ids to append after ``output_ids`` (the raw ids of the assistant turn that follows
        ``history``) so that ``new_messages`` and the next generation prompt come after it.

        The texts are those of rendering the whole conversation; the template's
        :class:`RenderPlan` says which parts come from a shorter render or a fixed text
        because a probe showed they are the same.
        ``assistant_text`` (the decoded output) is used only to check append-only-ness;
        without ``check_append_only`` the delta's ``append_only`` is True unchecked.
        ``plan``: ``render_plan(tools)`` when the caller holds it already."""
        plan = plan or self.render_plan(tools)
        context = plan.context(history)
        assistant = {"role": "assistant", "content": _SENTINEL}
        conv = [*context, assistant, *new_messages]
        tail_obs = _after_sentinel(self.render(conv, add_generation_prompt=False, tools=tools))
        prompt_text = ""
        if add_generation_prompt and plan.generation_prompt is not None:
            prompt_text = plan.generation_prompt
        elif add_generation_prompt:
            tail_gen = _after_sentinel(self.render(conv, add_generation_prompt=True, tools=tools))
            if tail_gen.startswith(tail_obs):
                prompt_text = tail_gen[len(tail_obs):]
            else:  # the generation prompt rewrote the end: keep the whole rendering as one piece
                tail_obs = tail_gen
        obs_ids = self.encode(tail_obs)
        closing = (self.encode(plan.closing) if plan.closing is not None
                   else self.closing_ids(context, tools))
        bound = _common_prefix_len(closing, obs_ids)
        emitted = _overlap(list(output_ids), obs_ids, bound)
        return Delta(observation_ids=obs_ids[emitted:], prompt_ids=self.encode(prompt_text),
                     closing_ids=obs_ids[emitted:bound],
                     append_only=not check_append_only or self.is_append_only(
                         [*history, {"role": "assistant", "content": assistant_text or ""}],
                         new_messages, tools=tools))

    def is_append_only(self, history: Sequence[Message], new_messages: Sequence[Message], *,
                       tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
        """Does rendering history + new messages start with the rendering of the history?

        Templates that rewrite earlier turns (e.g. drop reasoning from old assistant messages)
        are not; the ledger still appends only, so its ids then differ from a fresh render,
        which is correct: they are what the model saw.
        """
        before = self.render(history, add_generation_prompt=False, tools=tools)
        after = self.render([*history, *new_messages], add_generation_prompt=False, tools=tools)
        return after.startswith(before)

    def _find_anchor(self) -> tuple[str, list[int]]:
        tok = self.tokenizer
        for name in ("eos_token", "bos_token", "pad_token"):
            text = getattr(tok, name, None)
            if isinstance(text, str) and text:
                with self._lock:
                    ids = list(tok.encode(text, add_special_tokens=False))
                if len(ids) == 1:
                    return text, ids
        return "", []


def probe_render_plan(chat: ChatTokenizer,
                      tools: Sequence[Mapping[str, Any]] | None = None) -> RenderPlan:
    """Which of :class:`RenderPlan`'s shortcuts give exactly the full render's text for
    ``chat``'s template with ``tools``, shown on probe conversations.

    Every probe history (with and without a system prompt, user turns, assistant turns with
    text and with calls, tool results alone and in runs, contents that templates look into)
    is rendered with an assistant turn and each probe list of new messages after it, whole
    and windowed, with the generation prompt off and on. A shortcut is taken only if every
    probe agrees, where "agrees" includes the template refusing both renders; a template
    that refuses every probe gets no shortcut at all.
    """
    histories, news = _probe_chats(chat, tools)
    windowed = RenderPlan(window=True)
    refused: list[str] = []
    window = True
    generation: set[str] = set()
    closings: set[str] = set()
    gen_appends, rendered = True, False
    for history in histories:
        for new in news:
            conv = [*history, {"role": "assistant", "content": _SENTINEL}, *new]
            short = [*windowed.context(history), *conv[len(history):]]
            full_off = _tail_or_error(chat, conv, False, tools)
            full_on = _tail_or_error(chat, conv, True, tools)
            if window and (full_off != _tail_or_error(chat, short, False, tools)
                           or full_on != _tail_or_error(chat, short, True, tools)):
                window = False
                refused.append("the text after the assistant turn depends on history a "
                               "windowed render leaves out")
            if full_off[0] is None or full_on[0] is None:
                continue
            rendered = True
            if full_on[0].startswith(full_off[0]):
                generation.add(full_on[0][len(full_off[0]):])
            else:
                gen_appends = False
            if not new:
                closings.add(full_off[0])
    if not rendered:
        return RenderPlan(refused=("the template rendered no probe conversation",))
    generation_prompt = next(iter(generation)) if gen_appends and len(generation) == 1 else None
    if generation_prompt is None:
        refused.append("the generation prompt is not one text appended after every chat")
    closing = next(iter(closings)) if len(closings) == 1 else None
    if closing is None:
        refused.append("the closing of an assistant turn depends on the history")
    return RenderPlan(window=window, generation_prompt=generation_prompt, closing=closing,
                      refused=tuple(refused))


def _tail_or_error(chat: ChatTokenizer, conv: Sequence[Message], generation: bool,
                   tools: Sequence[Mapping[str, Any]] | None) -> tuple[str | None, str]:
    """The text after the sentinel, or (None, the error's type) where the template refuses."""
    try:
        return _after_sentinel(chat.render(conv, add_generation_prompt=generation,
                                           tools=tools)), ""
    except Exception as exc:  # jinja2 errors, raise_exception(...), ChatTemplateError
        return None, type(exc).__name__


_PROBE_TEXTS = ("a", "two words", "  padded  ", "line\nbreak", "<think>r</think>answer",
                "/no_think", '{"name": "f", "arguments": {}}', "x" * 40)


def _probe_chats(chat: ChatTokenizer, tools: Sequence[Mapping[str, Any]] | None,
                 ) -> tuple[list[list[Message]], list[list[Message]]]:
    """Probe histories (each ending where the model's turn starts) and lists of new
    messages, in the roles this template renders; drawn from a fixed seed, so one template
    is always probed with the same chats."""
    rng = random.Random(0x5EED)
    observation = chat.observation_role
    name = ""
    for tool in (tools or ()) if chat.supports_tools else ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            name = function["name"]
            break

    def text() -> str:
        return rng.choice(_PROBE_TEXTS)

    def assistant() -> Message:
        if name and rng.random() < 0.5:
            return {"role": "assistant", "content": rng.choice(("", text())), "tool_calls": [
                {"id": "call_probe", "type": "function",
                 "function": {"name": name, "arguments": {"x": text()}}}]}
        return {"role": "assistant", "content": text()}

    def results() -> list[Message]:
        if observation == "tool":
            return [{"role": "tool", "name": name or "probe", "content": text()}
                    for _ in range(rng.randint(1, 3))]
        return [{"role": "user", "content": text()}]

    histories: list[list[Message]] = []
    for k in range(10):
        chat_: list[Message] = []
        if k % 2 == 0:
            chat_.append({"role": "system", "content": text()})
        chat_.append({"role": "user", "content": text()})
        for _ in range(k % 5 + 1):
            chat_.append(assistant())
            chat_.extend(results() if rng.random() < 0.6 else
                         [{"role": "user", "content": text()}])
        histories.append(chat_)
    histories.append([{"role": "user", "content": text()}])
    histories.append([{"role": "system", "content": text()}, {"role": "user", "content": text()}])
    news: list[list[Message]] = [[], [{"role": "user", "content": text()}], results(),
                                 [*results(), {"role": "user", "content": text()}]]
    if observation == "tool":
        news.append([{"role": "tool", "name": name or "probe", "content": text()}] * 3)
    return histories, news


def _after_sentinel(text: str) -> str:
    if text.count(_SENTINEL) != 1:
        raise ChatTemplateError(
            "the chat template does not render an assistant message's content verbatim, so "
            "the tokens after a model turn cannot be computed without re-tokenizing it")
    return text.split(_SENTINEL, 1)[1]


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _overlap(output_ids: list[int], tail: list[int], bound: int) -> int:
    """Largest k <= bound with output_ids[-k:] == tail[:k]: closing tokens the model emitted."""
    for k in range(min(bound, len(output_ids)), 0, -1):
        if output_ids[-k:] == tail[:k]:
            return k
    return 0


@dataclass(frozen=True)
class LedgerMark:
    """A point of a :class:`ChatLedger` to roll back to."""

    tokens: int
    messages: int
    awaiting_output: bool
    last_output: tuple[int, ...]
    append_only: bool


@dataclass
class ChatLedger:
    """One conversation as token ids, grown turn by turn by appending only.

    ``messages`` mirrors the conversation as text so the template has context (assistant
    contents are decoded output, used only to render *later* messages, never tokenized).
    """

    chat: ChatTokenizer
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    token_ids: list[int] = field(default_factory=list)
    append_only: bool = True
    """False once any delta found a template that rewrites history (reported, not fixed)."""
    check_append_only: bool = True
    """Check it on every delta (two more renders of the whole conversation); a ledger whose
    owner never reports ``append_only`` (the gateway's chains) skips that work."""
    _awaiting_output: bool = False
    _last_output: list[int] = field(default_factory=list)
    _plan: RenderPlan | None = None
    """The chat's render plan for ``tools`` once known (neither changes in a ledger's life)."""

    def known_plan(self) -> RenderPlan | None:
        """:meth:`ChatTokenizer.known_render_plan` for this ledger's tools."""
        if self._plan is None:
            self._plan = self.chat.known_render_plan(self.tools)
        return self._plan

    def start(self, rendered: str | None = None) -> list[int]:
        """Ids of the initial prompt (turn 0's ``prompt_ids``). ``rendered``: the messages
        already rendered with the generation prompt by the caller (not rendered again)."""
        if self.token_ids:
            raise RuntimeError("ledger already started")
        ids = (self.chat.encode(rendered) if rendered is not None
               else self.chat.initial_prompt(self.messages, self.tools))
        _ = self.chat.end_of_turn_ids  # a template unfit for deltas fails here, before any turn
        self.token_ids = list(ids)
        self._awaiting_output = True
        return ids

    def add_output(self, output_ids: Sequence[int]) -> str:
        """Append the model's raw ids; return their text without trailing end-of-turn tokens."""
        if not self._awaiting_output:
            raise RuntimeError("add_output called twice without new messages in between")
        self._last_output = list(output_ids)
        self.token_ids.extend(self._last_output)
        text = self.chat.decode(self.strip_end_of_turn(self._last_output))
        self.messages.append({"role": "assistant", "content": text})
        self._awaiting_output = False
        return text

    def add_messages(self, new_messages: Sequence[Message], *,
                     add_generation_prompt: bool = True) -> Delta:
        """Append the ids of ``new_messages`` (and the next generation prompt)."""
        if self._awaiting_output:
            raise RuntimeError("add_messages needs a model turn before it")
        if self._plan is None:
            self._plan = self.chat.render_plan(self.tools)
        delta = self.chat.delta(self.messages[:-1], self._last_output, new_messages,
                                assistant_text=self.messages[-1]["content"], tools=self.tools,
                                add_generation_prompt=add_generation_prompt,
                                check_append_only=self.check_append_only, plan=self._plan)
        self.token_ids.extend(delta.observation_ids + delta.prompt_ids)
        self.messages.extend(dict(m) for m in new_messages)
        self.append_only = self.append_only and delta.append_only
        self._awaiting_output = add_generation_prompt
        return delta

    def mark(self) -> LedgerMark:
        """The ledger's state now, to :meth:`rollback` to if the turn about to start never
        happens (its generation failed or was cancelled)."""
        return LedgerMark(len(self.token_ids), len(self.messages), self._awaiting_output,
                          tuple(self._last_output), self.append_only)

    def rollback(self, mark: LedgerMark) -> None:
        """Drop everything appended since ``mark`` (only appends happen, so truncating
        restores it)."""
        del self.token_ids[mark.tokens:]
        del self.messages[mark.messages:]
        self._awaiting_output = mark.awaiting_output
        self._last_output = list(mark.last_output)
        self.append_only = mark.append_only

    def strip_end_of_turn(self, output_ids: Sequence[int]) -> list[int]:
        """The output without trailing end-of-turn / special tokens (an engine may stop on any
        of the model's EOS ids, e.g. ``<|endoftext|>`` as well as ``<|im_end|>``)."""
        ends = self.chat.end_of_turn_ids | self.chat.special_ids
        ids = list(output_ids)
        while ids and ids[-1] in ends:
            ids.pop()
        return ids
