"""The file editor tool, on a real sandbox's workspace."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import Sandbox
from rollout.runtime.tools import make_tools
from rollout.runtime.tools.editor import EditorError, FileEditor
from tests.runtime.sandbox_helpers import temp_sandbox

pytestmark = pytest.mark.timeout(60)

TEXT = "".join(f"line {i}\n" for i in range(1, 11))


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("re", workspace_files={"f.txt": TEXT}) as sandbox:
        yield sandbox


async def test_view_whole_file_and_ranges(sb: Sandbox) -> None:
    ed = FileEditor(sb)
    out = await ed.view("f.txt")
    assert out.startswith(f"{sb.workspace_in_sandbox}/f.txt:\n     1\tline 1\n")
    assert out.endswith("    10\tline 10")
    out = await ed.view(f"{sb.workspace_in_sandbox}/f.txt", [3, 4])
    assert out.split("\n")[1:] == ["     3\tline 3", "     4\tline 4"]
    assert (await ed.view("f.txt", [9, -1])).split("\n")[1:] == ["     9\tline 9",
                                                                  "    10\tline 10"]
    with pytest.raises(EditorError):
        await ed.view("f.txt", [0, 4])
    with pytest.raises(EditorError, match="does not exist"):
        await ed.view("nope.txt")


async def test_view_directory_and_files_outside_workspace(sb: Sandbox) -> None:
    ed = FileEditor(sb)
    assert "f.txt" in await ed.view(".")
    assert "root:" in await ed.view("/etc/passwd")
    with pytest.raises(EditorError, match="outside the workspace"):
        await ed.create("/etc/new.conf", "x")


async def test_create_replace_insert_undo(sb: Sandbox) -> None:
    ed = FileEditor(sb)
    await ed.create("pkg/new.py", "a = 1\nb = 2\n")
    assert await sb.get_file("pkg/new.py") == b"a = 1\nb = 2\n"
    with pytest.raises(EditorError, match="already exists"):
        await ed.create("pkg/new.py", "again")
    out = await ed.str_replace("pkg/new.py", "b = 2", "b = 3")
    assert "b = 3" in out
    await ed.insert("pkg/new.py", 0, "# header\n")
    await ed.insert("pkg/new.py", 3, "c = 4")
    assert await sb.get_file("pkg/new.py") == b"# header\na = 1\nb = 3\nc = 4\n"
    await ed.undo_edit("pkg/new.py")
    await ed.undo_edit("pkg/new.py")
    assert await sb.get_file("pkg/new.py") == b"a = 1\nb = 3\n"
    await ed.undo_edit("pkg/new.py")
    assert await sb.get_file("pkg/new.py") == b"a = 1\nb = 2\n"
    await ed.undo_edit("pkg/new.py")  # undoes the create
    with pytest.raises(FileNotFoundError):
        await sb.get_file("pkg/new.py")
    with pytest.raises(EditorError, match="no edit"):
        await ed.undo_edit("pkg/new.py")
    # the sandbox sees the edits (same files)
    await ed.create("seen.txt", "visible")
    assert (await sb.exec("cat seen.txt")).stdout == "visible"


async def test_replace_requires_a_unique_match(sb: Sandbox) -> None:
    ed = FileEditor(sb)
    with pytest.raises(EditorError, match="occurs 10 times"):
        await ed.str_replace("f.txt", "line", "row")
    with pytest.raises(EditorError, match="not found"):
        await ed.str_replace("f.txt", "line 11", "row")
    await ed.str_replace("f.txt", "line 10\n", "")
    assert (await sb.get_file("f.txt")).decode().endswith("line 9\n")


async def test_invalid_utf8_survives_an_edit(sb: Sandbox) -> None:
    await sb.put_file("bin.txt", b"keep \xff\xfe here\nchange me\n")
    ed = FileEditor(sb)
    await ed.str_replace("bin.txt", "change me", "changed")
    assert await sb.get_file("bin.txt") == b"keep \xff\xfe here\nchanged\n"
    assert "\\xff" in await ed.view("bin.txt")


async def test_symlink_to_host_file_is_refused(sb: Sandbox, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("host")
    os.symlink(victim, sb.workspace / "evil")
    ed = FileEditor(sb)
    with pytest.raises(EditorError):
        await ed.str_replace("evil", "host", "pwned")
    assert victim.read_text() == "host"


async def test_tool_interface_reports_errors_as_results(sb: Sandbox) -> None:
    (tool,) = make_tools(sb, names=("editor",))
    ok = await tool({"command": "view", "path": "f.txt", "view_range": [1, 1]})
    assert not ok.is_error and ok.output.endswith("     1\tline 1")
    bad = await tool({"command": "str_replace", "path": "f.txt", "old_str": "zzz"})
    assert bad.is_error and "not found" in bad.output
    assert (await tool({"command": "explode", "path": "f.txt"})).is_error
    assert (await tool({"command": "view"})).is_error
    assert (await tool({"command": "create", "path": "x", "file_text": 5})).is_error
