"""The file editor tool (view / create / str_replace / insert / undo_edit).

Edits go through the sandbox's host-side file API (``get_file`` / ``put_file``), which never
follows a symlink planted by the sandbox, so an edit takes microseconds instead of a process
spawn and cannot be turned against host files. Paths outside the workspace can be viewed
(through ``cat`` inside the sandbox, so the sandbox's own view of the file system applies)
but not edited: the rest of the sandbox is read-only anyway.

Text is decoded with ``surrogateescape`` so a file with invalid UTF-8 survives an edit byte for
byte.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Mapping
from typing import Any

from rollout.runtime.sandbox import hostfs
from rollout.runtime.tools.base import ToolResult

SNIPPET_LINES = 4
MAX_VIEW_CHARS = 16 * 1024
MAX_READ_BYTES = 16 << 20
"""Largest file the editor reads outside the workspace (the workspace's own cap is hostfs's)."""
_CAT_REGULAR = ('[ -f "$1" ] || { echo "not a regular file (FIFO, device or directory)" >&2; '
                'exit 1; }; exec cat -- "$1"')


class EditorError(ValueError):
    """A request the model can fix (bad path, string not found, not unique, ...)."""


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _numbered(text: str, start: int = 1) -> str:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start)).encode(
        "utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class FileEditor:
    """Python API for handlers; one instance per sandbox (it keeps the undo history)."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self._history: dict[str, list[bytes | None]] = {}

    def _resolve(self, path: str) -> tuple[str, str | None]:
        """(absolute sandbox path, workspace-relative path or None when outside)."""
        root = self.sandbox.workspace_in_sandbox.rstrip("/")
        full = posixpath.normpath(path if path.startswith("/") else f"{root}/{path}")
        if full == root:
            return full, ""
        if full.startswith(root + "/"):
            return full, full[len(root) + 1:]
        return full, None

    async def _read(self, path: str) -> tuple[str, bytes]:
        full, rel = self._resolve(path)
        if rel is None:
            # Inside the sandbox, but still refuse FIFOs and devices: `cat` of one would hang
            # until the timeout or stream without end.
            res = await self.sandbox.exec(["bash", "-c", _CAT_REGULAR, "cat", full],
                                          timeout=30, max_output=MAX_READ_BYTES)
            if res.truncated:
                raise EditorError(f"{full} is larger than {MAX_READ_BYTES} bytes")
            if res.exit_code != 0:
                raise EditorError(f"cannot read {full}: {res.stderr.strip()}")
            return full, res.stdout.encode("utf-8", "surrogateescape")
        try:
            return full, await self.sandbox.get_file(rel)
        except hostfs.SpecialFileError as e:
            raise EditorError(f"cannot read {full}: {e}") from None
        except FileNotFoundError:
            raise EditorError(f"{full} does not exist") from None
        except IsADirectoryError:
            raise EditorError(f"{full} is a directory") from None
        except (PermissionError, NotADirectoryError) as e:
            raise EditorError(f"cannot read {full}: {e}") from None

    async def _write(self, path: str, data: bytes, *, record: bool = True,
                     before: bytes | None = None) -> str:
        full, rel = self._resolve(path)
        if not rel:
            raise EditorError(f"{full} is outside the workspace "
                              f"({self.sandbox.workspace_in_sandbox}); only files there can "
                              "be created or edited")
        try:
            await self.sandbox.put_file(rel, data)
        except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
            raise EditorError(f"cannot write {full}: {e}") from None
        if record:
            self._history.setdefault(full, []).append(before)
        return full

    async def view(self, path: str, view_range: list[int] | None = None) -> str:
        full, rel = self._resolve(path)
        if rel == "" or await self._is_dir(full):
            res = await self.sandbox.exec(
                ["find", full, "-maxdepth", "2", "-not", "-path", "*/.*"], timeout=30)
            return f"Files under {full} (2 levels, hidden excluded):\n{res.stdout}"
        _, data = await self._read(path)
        text = _decode(data)
        lines = text.split("\n")
        start = 1
        if view_range:
            if len(view_range) != 2 or not all(isinstance(v, int) for v in view_range):
                raise EditorError("view_range must be [start, end] (1-based; end -1 = last)")
            start, end = view_range
            n = len(lines)
            if end == -1:
                end = n
            if not (1 <= start <= n) or end < start:
                raise EditorError(f"view_range {view_range} is outside 1..{n} for {full}")
            text = "\n".join(lines[start - 1:end])
        out = _numbered(text, start)
        if len(out) > MAX_VIEW_CHARS:
            out = (out[:MAX_VIEW_CHARS] + "\n[... file view truncated; use view_range to see "
                   "more ...]")
        return f"{full}:\n{out}"

    async def _is_dir(self, full: str) -> bool:
        _, rel = self._resolve(full)
        if rel is not None:  # no link followed on the way (hostfs)
            try:
                kind = await asyncio.to_thread(hostfs.kind_beneath, self.sandbox.workspace, rel)
            except PermissionError:  # a link where a directory should be
                return False
            return kind == "dir"
        res = await self.sandbox.exec(["test", "-d", full], timeout=30)
        return res.exit_code == 0

    async def create(self, path: str, file_text: str) -> str:
        full, rel = self._resolve(path)
        try:
            _, old = await self._read(path) if rel else (full, None)
        except EditorError:
            old = None
        if old is not None:
            raise EditorError(f"{full} already exists; use str_replace or insert to edit it")
        await self._write(path, _encode(file_text), before=None)
        return f"Created {full}"

    async def str_replace(self, path: str, old_str: str, new_str: str = "") -> str:
        full, data = await self._read(path)
        text = _decode(data)
        count = text.count(old_str) if old_str else 0
        if count == 0:
            raise EditorError(f"old_str was not found in {full}; it must match exactly "
                              "(including whitespace)")
        if count > 1:
            lines = [i + 1 for i, line in enumerate(text.split("\n")) if old_str in line]
            where = f" (lines {lines[:10]})" if lines else ""
            raise EditorError(f"old_str occurs {count} times in {full}{where}; include more "
                              "context to make it unique")
        new_text = text.replace(old_str, new_str, 1)
        await self._write(path, _encode(new_text), before=data)
        line = text[:text.index(old_str)].count("\n") + 1
        return self._snippet(full, new_text, line, new_str.count("\n"))

    async def insert(self, path: str, insert_line: int, new_str: str) -> str:
        full, data = await self._read(path)
        text = _decode(data)
        lines = text.split("\n")
        n = len(lines) - (1 if lines and lines[-1] == "" else 0)
        if not isinstance(insert_line, int) or not (0 <= insert_line <= n):
            raise EditorError(f"insert_line must be in 0..{n} for {full}")
        add = new_str.split("\n")
        if add and add[-1] == "":
            add.pop()
        new_text = "\n".join(lines[:insert_line] + add + lines[insert_line:])
        await self._write(path, _encode(new_text), before=data)
        return self._snippet(full, new_text, insert_line + 1, len(add))

    async def undo_edit(self, path: str) -> str:
        full, _ = self._resolve(path)
        stack = self._history.get(full)
        if not stack:
            raise EditorError(f"no edit of {full} to undo")
        before = stack.pop()
        if before is None:  # undo a create: remove the file again
            _, rel = self._resolve(path)
            await self.sandbox.remove_file(rel or "")
            return f"Undid the creation of {full} (file removed)"
        await self._write(path, before, record=False)
        return f"Undid the last edit of {full}:\n" + _numbered(_decode(before)[:MAX_VIEW_CHARS])

    @staticmethod
    def _snippet(full: str, text: str, line: int, added: int) -> str:
        lines = text.split("\n")
        lo = max(1, line - SNIPPET_LINES)
        hi = min(len(lines), line + added + SNIPPET_LINES)
        body = _numbered("\n".join(lines[lo - 1:hi]), lo)
        return f"Edited {full}. Here is the changed region:\n{body}"


class EditorTool:
    """The agent-facing ``editor`` tool (Anthropic/OpenHands ``str_replace_editor`` shape)."""

    name = "editor"
    description = ("View, create and edit files. Commands: view (a file with line numbers, "
                   "optionally a [start, end] view_range; or a directory), create (a new file), "
                   "str_replace (replace old_str, which must occur exactly once, by new_str), "
                   "insert (new_str after line insert_line; 0 = top), undo_edit (revert the "
                   "last edit of the file). Relative paths are in the workspace.")
    parameters: Mapping[str, Any] = {
        "type": "object",
        "properties": {
            "command": {"type": "string",
                        "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
            "path": {"type": "string"},
            "file_text": {"type": "string", "description": "create: the file's content."},
            "old_str": {"type": "string"},
            "new_str": {"type": "string"},
            "insert_line": {"type": "integer"},
            "view_range": {"type": "array", "items": {"type": "integer"},
                           "minItems": 2, "maxItems": 2},
        },
        "required": ["command", "path"],
    }

    def __init__(self, sandbox: Any) -> None:
        self.editor = FileEditor(sandbox)

    async def __call__(self, arguments: Mapping[str, Any]) -> ToolResult:
        cmd, path = arguments.get("command"), arguments.get("path")
        if not isinstance(path, str) or not path:
            return ToolResult("editor needs a string argument 'path'", is_error=True)
        ed = self.editor
        try:
            if cmd == "view":
                return ToolResult(await ed.view(path, arguments.get("view_range")))
            if cmd == "create":
                return ToolResult(await ed.create(path, _str(arguments, "file_text")))
            if cmd == "str_replace":
                return ToolResult(await ed.str_replace(
                    path, _str(arguments, "old_str"), _str(arguments, "new_str", "")))
            if cmd == "insert":
                return ToolResult(await ed.insert(path, arguments.get("insert_line", -1),
                                                  _str(arguments, "new_str")))
            if cmd == "undo_edit":
                return ToolResult(await ed.undo_edit(path))
        except EditorError as e:
            return ToolResult(str(e), is_error=True)
        return ToolResult(f"unknown editor command {cmd!r}; use view, create, str_replace, "
                          "insert or undo_edit", is_error=True)


def _str(arguments: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = arguments.get(key, default)
    if not isinstance(value, str):
        raise EditorError(f"'{key}' must be a string")
    return value
