"""Parsing Hermes/Qwen tool calls and the fenced-bash fallback; the parser never raises."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.runtime.toolcalls import parse_tool_calls
from rollout.runtime.tools.base import ToolCall, ToolCallError


def call(name: str, /, **args: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_single_and_multiple_calls_in_order() -> None:
    text = "Let me look.\n" + call("bash", command="ls -la") + "\nthen\n" + call(
        "editor", command="view", path="a.py")
    assert parse_tool_calls(text) == [
        ToolCall("bash", {"command": "ls -la"}),
        ToolCall("editor", {"command": "view", "path": "a.py"}),
    ]


def test_no_call_means_empty_list() -> None:
    assert parse_tool_calls("The answer is 42.") == []
    assert parse_tool_calls("") == []


def test_string_encoded_arguments_and_openai_nesting() -> None:
    text = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1+1\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("python", {"code": "1+1"})]
    text = '<tool_call>{"function": {"name": "bash", "arguments": {"command": "x"}}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("bash", {"command": "x"})]
    assert parse_tool_calls('<tool_call>{"name": "finish"}</tool_call>') == [
        ToolCall("finish", {})]


def test_unclosed_final_call_cut_by_a_stop_string_is_accepted() -> None:
    assert parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}') == [
        ToolCall("bash", {"command": "pwd"})]


def test_malformed_calls_become_errors_in_place() -> None:
    text = (call("bash", command="ok") + '<tool_call>{"name": "bash", "arguments": {oops}'
            "</tool_call>" + "<tool_call>[1, 2]</tool_call>"
            + '<tool_call>{"name": "bash", "arguments": [1]}</tool_call>'
            + '<tool_call>{"arguments": {}}</tool_call><tool_call></tool_call>'
            + "stray </tool_call>")
    out = parse_tool_calls(text)
    assert out[0] == ToolCall("bash", {"command": "ok"})
    assert all(isinstance(x, ToolCallError) for x in out[1:])
    assert len(out) == 7
    assert "not valid JSON" in out[1].message  # type: ignore[union-attr]
    assert out[1].raw  # type: ignore[union-attr]


def test_unclosed_call_followed_by_another_is_an_error() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}' + call("b")
    out = parse_tool_calls(text)
    assert isinstance(out[0], ToolCallError) and out[1] == ToolCall("b", {})


def test_fenced_bash_fallback() -> None:
    text = "Run this:\n```bash\ncd /tmp\nls\n```\nand\n```sh\necho hi\n```\n```python\nx=1\n```"
    assert parse_tool_calls(text) == [ToolCall("bash", {"command": "cd /tmp\nls"}),
                                      ToolCall("bash", {"command": "echo hi"})]
    assert parse_tool_calls("```console\n$ pwd\n/root\n```") == [
        ToolCall("bash", {"command": "pwd"})]


def test_tagged_calls_take_precedence_over_fences() -> None:
    text = "```bash\nrm -rf /\n```\n" + call("bash", command="ls")
    assert parse_tool_calls(text) == [ToolCall("bash", {"command": "ls"})]


fragments = st.sampled_from(["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"bash"',
                             '"arguments"', "[", "]", ",", "```bash\n", "```", "\n", "null",
                             '"\\u0000"', "1e999", '"'])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(fragments, st.text(max_size=20)), max_size=30))
def test_never_raises_on_arbitrary_text(parts: list[str]) -> None:
    out = parse_tool_calls("".join(parts))
    assert isinstance(out, list)
    for item in out:
        assert isinstance(item, ToolCall | ToolCallError)
        if isinstance(item, ToolCall):
            assert isinstance(item.name, str) and isinstance(item.arguments, dict)


@settings(max_examples=200, deadline=None)
@given(st.text(), st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=3))
def test_well_formed_calls_round_trip(name_suffix: str, args: dict[str, str]) -> None:
    name = "tool_" + "".join(c for c in name_suffix if c.isascii() and c.isalnum())[:20]
    out = parse_tool_calls("prefix " + call(name, **args) + " suffix")
    assert out == [ToolCall(name, args)]
