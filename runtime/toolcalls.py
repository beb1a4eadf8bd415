"""Parsing tool calls out of model text. Never raises: a bad call becomes a ToolCallError.

Formats, in order of precedence:

1. Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number
   of them. ``arguments`` may also be a JSON-encoded string (some models double-encode), and a
   final call whose closing tag was cut off by a stop string is still accepted when its JSON is
   complete.
2. Fallback when there is no ``<tool_call>`` at all: fenced code blocks tagged ``bash`` / ``sh``
   / ``shell`` become ``bash`` calls, so small models that answer in Markdown still act.

A malformed call is returned as :class:`ToolCallError` in its position, so the agent loop can
show the model what was wrong and let it retry instead of crashing the rollout.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rollout.runtime.tools.base import ToolCall, ToolCallError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```[ \t]*(bash|sh|shell|console)[ \t]*\n(.*?)```", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,63}$")
MAX_RAW = 400


def _clip(text: str) -> str:
    return text if len(text) <= MAX_RAW else text[:MAX_RAW] + "..."


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """All tool calls in ``text``, in order; an empty list means the model called nothing."""
    try:
        if not isinstance(text, str):
            return [ToolCallError(f"model output is {type(text).__name__}, not text")]
        if OPEN in text or CLOSE in text:
            return _parse_tagged(text)
        return _parse_fenced(text)
    except Exception as e:  # defensive: the contract is "never raises"
        return [ToolCallError(f"could not parse tool calls: {e}", _clip(text))]


def _parse_tagged(text: str) -> list[ToolCall | ToolCallError]:
    out: list[ToolCall | ToolCallError] = []
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


def _parse_fenced(text: str) -> list[ToolCall | ToolCallError]:
    out: list[ToolCall | ToolCallError] = []
    for m in _FENCE.finditer(text):
        command = m.group(2).strip("\n")
        if m.group(1) == "console":  # "$ cmd" transcripts: keep only the prompt lines
            command = "\n".join(line[2:] for line in command.split("\n")
                                if line.startswith("$ "))
        if command.strip():
            out.append(ToolCall(name="bash", arguments={"command": command}))
    return out
