"""Tool-call formats by model family, and parsing calls out of model text. Never raises.

Each model family is trained to write tool calls its own way, and its chat template says which
(when it renders ``tools``, it also tells the model how to answer). :data:`TOOL_CALL_FORMATS`
maps a family name to a :class:`ToolCallFormat`; :func:`detect_format` picks one from the chat
template's text, and a job or environment may name one explicitly instead:

- ``hermes`` (Hermes, Qwen 2.5/3, SmolLM2's training data): ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, any number of them. ``arguments`` may be a JSON-encoded
  string (some models double-encode); a final call whose closing tag was cut off by a stop
  string is still accepted when its JSON is complete.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3): a bare JSON object ``{"name": ..., "parameters": {...}}``
  (``arguments`` accepted too), optionally after ``<|python_tag|>`` or inside a fenced block,
  several separated by ``;`` or newlines.
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, and the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` spelling.

Whatever the format, leading reasoning is removed first: a call written inside
``<think>...</think>`` is the model thinking about a call, not making one, so it is never
run. When a format finds no call at all, fenced code blocks become calls of the tool their
language names, among the tools the job has (``fence_tools``): ``bash`` / ``sh`` / ``shell`` /
``console`` blocks call ``bash``, ``python`` / ``py`` blocks call ``python`` — the
tool-integrated-reasoning style of math agents (ToRA, Qwen-Math TIR), and how small models answer
when they do not follow a tool-call syntax. A block in a language the job has no tool for stays
text (a ``python`` block in the ``code`` environment is the model showing its solution).

A malformed call is returned as :class:`ToolCallError` in its position, so the agent loop can
show the model what was wrong and let it retry instead of crashing the rollout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.runtime.tools.base import ToolCall, ToolCallError

Parsed = list[ToolCall | ToolCallError]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PYTHON_TAG = "<|python_tag|>"
_FENCE = re.compile(r"```[ \t]*(bash|sh|shell|console|python3?|py)[ \t]*\n(.*?)```", re.DOTALL)
FENCE_TOOLS: Mapping[str, tuple[str, str]] = {
    "bash": ("bash", "command"), "sh": ("bash", "command"), "shell": ("bash", "command"),
    "console": ("bash", "command"), "python": ("python", "code"),
    "python3": ("python", "code"), "py": ("python", "code")}
"""Fence language -> (tool name, the argument that gets the block's text)."""
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.\-]{0,63})\s*(?:\[CALL_ID\]\s*\w+\s*)?")
MAX_RAW = 400
DEFAULT_FORMAT = "hermes"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RAW else text[:MAX_RAW] + "..."


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes tool calls."""

    name: str
    parse: Callable[[str], Parsed]
    """Calls in reasoning-free text, in order (may raise: :func:`parse_tool_calls` guards)."""
    instructions: Callable[[Sequence[Mapping[str, Any]]], str]
    """System-prompt section listing the tool schemas and the answer format, for chat
    templates that do not render ``tools`` themselves."""
    markers: tuple[str, ...]
    """Template text that identifies the family (any one suffices)."""


def strip_reasoning(text: str, *, opened: bool = False) -> str:
    """``text`` without the reasoning that leads it.

    Reasoning models think first: the turn starts with ``<think>...</think>`` (possibly after
    whitespace), and an unclosed ``<think>`` hides everything after it (the turn ended while
    the model was still thinking). ``opened``: the chat template's generation prompt already
    wrote ``<think>`` (Qwen3 style), so the output starts inside reasoning and everything up to
    the first ``</think>`` goes. Only leading blocks count: ``<think>`` later in the text (say,
    inside a file the model writes through a tool) is content, not reasoning.
    """
    if opened:
        _, sep, rest = text.partition(THINK_CLOSE)
        if not sep:
            return ""
        text = rest
    while text.lstrip().startswith(THINK_OPEN):
        body = text.lstrip()[len(THINK_OPEN):]
        _, sep, rest = body.partition(THINK_CLOSE)
        if not sep:
            return ""
        text = rest
    return text


def parse_tool_calls(text: str, fmt: str | ToolCallFormat = DEFAULT_FORMAT, *,
                     reasoning_opened: bool = False,
                     fence_tools: Collection[str] = ("bash",)) -> Parsed:
    """All tool calls in ``text`` written in format ``fmt``, in order; an empty list means the
    model called nothing. Leading reasoning is stripped first (see :func:`strip_reasoning`;
    ``reasoning_opened`` is its ``opened``); without a call in ``fmt``, fenced blocks call the
    tools of ``fence_tools`` their language names (:data:`FENCE_TOOLS`); never raises."""
    try:
        if not isinstance(text, str):
            return [ToolCallError(f"model output is {type(text).__name__}, not text")]
        spec = fmt if isinstance(fmt, ToolCallFormat) else TOOL_CALL_FORMATS.get(fmt)
        if spec is None:
            return [ToolCallError(f"unknown tool-call format {fmt!r}")]
        visible = strip_reasoning(text, opened=reasoning_opened)
        return spec.parse(visible) or _parse_fenced(visible, fence_tools)
    except Exception as e:  # defensive: the contract is "never raises"
        return [ToolCallError(f"could not parse tool calls: {e}", _clip(str(text)))]


# ----------------------------------------------------------------------------- hermes / qwen


def _parse_hermes(text: str) -> Parsed:
    out: Parsed = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        stray = text.find(CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            out.append(ToolCallError(f"found {CLOSE} without a matching {OPEN}",
                                     _clip(text[max(0, stray - 100):stray + len(CLOSE)])))
            pos = stray + len(CLOSE)
            continue
        if start == -1:
            return out
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        nxt = text.find(OPEN, body_start)
        if end == -1 or (nxt != -1 and nxt < end):
            stop = nxt if nxt != -1 else len(text)
            body = text[body_start:stop]
            call = _parse_body(body)
            if isinstance(call, ToolCall) and nxt == -1:
                out.append(call)  # cut off by a stop string after a complete JSON object
            else:
                out.append(ToolCallError(f"{OPEN} is not closed by {CLOSE}"
                                         + (f" ({call.message})"
                                            if isinstance(call, ToolCallError) else ""),
                                         _clip(body)))
            pos = stop
            continue
        out.append(_parse_body(text[body_start:end]))
        pos = end + len(CLOSE)


def _parse_body(body: str) -> ToolCall | ToolCallError:
    raw = body.strip()
    if raw.startswith("```"):  # some models fence the JSON inside the tag
        raw = raw.strip("`").removeprefix("json").strip()
    if not raw:
        return ToolCallError("empty tool call; expected {\"name\": ..., \"arguments\": {...}}")
    try:
        obj, end = json.JSONDecoder().raw_decode(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"tool call is not valid JSON: {e.msg} at position {e.pos}",
                             _clip(raw))
    if raw[end:].strip():
        return ToolCallError("unexpected text after the tool call's JSON object", _clip(raw))
    return _to_call(obj, raw)


def _to_call(obj: Any, raw: str) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError("tool call must be a JSON object with 'name' and 'arguments'",
                             _clip(raw))
    if "function" in obj and isinstance(obj["function"], dict):  # OpenAI-style nesting
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        return ToolCallError("tool call needs a 'name' string naming a tool", _clip(raw))
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(f"'arguments' of {name} is a string that is not JSON: {e.msg}",
                                 _clip(raw))
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(f"'arguments' of {name} must be a JSON object", _clip(raw))
    return ToolCall(name=name, arguments=args)


def _hermes_instructions(schemas: Sequence[Mapping[str, Any]]) -> str:
    lines = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


# ----------------------------------------------------------------------------- llama 3


def _parse_llama3(text: str) -> Parsed:
    """Bare JSON objects that look like calls. Prose may hold other JSON (an example value,
    a result); only objects with a ``name`` and ``parameters``/``arguments`` count, and text
    that starts like a call (``{"name"``) but is not valid JSON is reported."""
    text = text.replace(PYTHON_TAG, "")
    out: Parsed = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        start = text.find("{", pos)
        if start == -1:
            return out
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as e:
            if re.match(r'\{\s*"(name|function)"\s*:', text[start:]):
                out.append(ToolCallError(f"tool call is not valid JSON: {e.msg}",
                                         _clip(text[start:])))
                return out  # the rest of the text is inside the broken object
            pos = start + 1
            continue
        if isinstance(obj, dict) and ("name" in obj or "function" in obj) and (
                {"parameters", "arguments"} & set(obj.get("function", obj))):
            out.append(_to_call(obj, text[start:end]))
            pos = end
        else:
            pos = start + 1  # not a call: look inside it and after it


def _llama3_instructions(schemas: Sequence[Mapping[str, Any]]) -> str:
    # Llama 3.1's own wording for JSON-based tool calling (its template writes the same).
    listed = "\n\n".join(json.dumps(s, indent=4, ensure_ascii=False) for s in schemas)
    return ("Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + listed)


# ----------------------------------------------------------------------------- mistral


def _parse_mistral(text: str) -> Parsed:
    out: Parsed = []
    decoder = json.JSONDecoder()
    chunks = text.split(MISTRAL_TAG)[1:]
    for chunk in chunks:
        body = chunk.strip()
        if body.startswith(("[", "{")):  # v3: a JSON list (or one object) of calls
            try:
                obj, _ = decoder.raw_decode(body)
            except json.JSONDecodeError as e:
                out.append(ToolCallError(f"{MISTRAL_TAG} is not followed by valid JSON: "
                                         f"{e.msg}", _clip(body)))
                continue
            items = obj if isinstance(obj, list) else [obj]
            if not items:
                out.append(ToolCallError(f"{MISTRAL_TAG} holds an empty list", _clip(body)))
            out.extend(_to_call(item, body) for item in items)
            continue
        m = _MISTRAL_NAMED.match(body)  # v11+: name[ARGS]{json}
        rest = body[m.end():] if m else ""
        if not m or not rest.startswith(MISTRAL_ARGS):
            out.append(ToolCallError(f"expected a JSON list or name{MISTRAL_ARGS}{{...}} after "
                                     f"{MISTRAL_TAG}", _clip(body)))
            continue
        args_text = rest[len(MISTRAL_ARGS):].strip()
        try:
            args, _ = decoder.raw_decode(args_text)
        except json.JSONDecodeError as e:
            out.append(ToolCallError(f"arguments of {m.group(1)} are not valid JSON: {e.msg}",
                                     _clip(body)))
            continue
        out.append(_to_call({"name": m.group(1), "arguments": args}, body))
    return out


def _mistral_instructions(schemas: Sequence[Mapping[str, Any]]) -> str:
    listed = json.dumps(list(schemas), ensure_ascii=False)
    return (f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\n\nTo call tools, answer with "
            f'{MISTRAL_TAG} followed by a JSON list: {MISTRAL_TAG}[{{"name": <function-name>, '
            '"arguments": <args-json-object>}]')


# ----------------------------------------------------------------------------- registry


def _parse_fenced(text: str, tools: Collection[str]) -> Parsed:
    out: Parsed = []
    for m in _FENCE.finditer(text):
        tool, argument = FENCE_TOOLS[m.group(1)]
        if tool not in tools:
            continue
        body = m.group(2).strip("\n")
        if m.group(1) == "console":  # "$ cmd" transcripts: keep only the prompt lines
            body = "\n".join(line[2:] for line in body.split("\n") if line.startswith("$ "))
        if body.strip():
            out.append(ToolCall(name=tool, arguments={argument: body}))
    return out


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (
        ToolCallFormat("mistral", _parse_mistral, _mistral_instructions,
                       (MISTRAL_TAG, "[AVAILABLE_TOOLS]")),
        ToolCallFormat("hermes", _parse_hermes, _hermes_instructions, (OPEN,)),
        ToolCallFormat("llama3", _parse_llama3, _llama3_instructions,
                       (PYTHON_TAG, '"parameters": dictionary of argument name')),
    )
}
"""Formats by model family; :func:`detect_format` tries them in this order."""


def detect_format(template_source: str) -> str:
    """The format a chat template teaches, by its text; ``hermes`` when none is recognised
    (the system prompt the loop writes for such templates teaches ``<tool_call>``)."""
    for fmt in TOOL_CALL_FORMATS.values():
        if any(marker in template_source for marker in fmt.markers):
            return fmt.name
    return DEFAULT_FORMAT


def write_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]],
                     fmt: str = DEFAULT_FORMAT) -> str:
    """``(name, arguments)`` calls written as a model of family ``fmt`` writes them (what
    :func:`parse_tool_calls` reads back), for rendering an earlier assistant message whose
    calls arrive structured (an OpenAI ``tool_calls`` list) to a template that cannot."""
    if not calls:
        return ""
    if fmt == "mistral":
        listed = [{"name": n, "arguments": dict(a)} for n, a in calls]
        return MISTRAL_TAG + json.dumps(listed, ensure_ascii=False)
    if fmt == "llama3":
        return "; ".join(json.dumps({"name": n, "parameters": dict(a)}, ensure_ascii=False)
                         for n, a in calls)
    return "\n".join(f"{OPEN}\n{json.dumps({'name': n, 'arguments': dict(a)}, ensure_ascii=False)}"
                     f"\n{CLOSE}" for n, a in calls)
