"""Agent tools: persistent bash, IPython kernel, file editor; see :func:`make_tools`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rollout.runtime.tools.base import Tool, ToolCall, ToolCallError, ToolResult, tool_schema

DEFAULT_TOOLS = ("bash", "python", "editor")


def make_tools(sandbox: Any, names: Iterable[str] = DEFAULT_TOOLS, *,
               tool_timeout_s: float | None = None, **options: Any) -> list[Tool]:
    """Build the named tools bound to ``sandbox`` (processes start lazily on first call).

    ``tool_timeout_s`` (the job's ``limits.tool_timeout``) caps every call, whatever timeout
    the model asks for: a runaway command must not eat the whole RUN deadline. ``options`` are
    passed by name prefix: ``bash_timeout`` -> BashTool(default_timeout=...),
    ``python_timeout`` -> IPythonTool(default_timeout=...).
    """
    cap = 600.0 if tool_timeout_s is None else tool_timeout_s
    from rollout.runtime.tools.bash import BashTool
    from rollout.runtime.tools.editor import EditorTool
    from rollout.runtime.tools.ipython import IPythonTool

    tools: list[Tool] = []
    for name in names:
        if name == "bash":
            tools.append(BashTool(sandbox, default_timeout=options.get("bash_timeout", 60.0),
                                  max_timeout=cap))
        elif name in ("python", "ipython"):
            tools.append(IPythonTool(sandbox,
                                     default_timeout=options.get("python_timeout", 60.0),
                                     max_timeout=cap))
        elif name in ("editor", "str_replace_editor"):
            tools.append(EditorTool(sandbox))
        else:
            raise ValueError(f"unknown tool {name!r}; known: bash, python, editor")
    return tools


__all__ = ["DEFAULT_TOOLS", "Tool", "ToolCall", "ToolCallError", "ToolResult", "make_tools",
           "tool_schema"]
