"""Host-side file access on behalf of a job never blocks on special files nor follows links.

A model can ``mkfifo`` a path and ask the editor to view it: a plain ``open()`` on the host
then waits for a writer forever and holds a worker thread. These tests run the real editor on
a real bwrap sandbox and bound every call with a short deadline, so a regression shows up as a
timeout instead of a hung suite.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout.runtime.sandbox import Sandbox, hostfs
from rollout.runtime.tools.editor import EditorTool
from tests.runtime.sandbox_helpers import temp_sandbox

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def sb() -> AsyncIterator[Sandbox]:
    async with temp_sandbox("hf", workspace_files={"ok.txt": "fine\n"}) as sandbox:
        yield sandbox


def _threads_inside_hostfs() -> list[str]:
    """Names of threads whose current stack passes through hostfs (e.g. stuck in open())."""
    stuck = []
    for frame in sys._current_frames().values():
        f: object = frame
        while f is not None:
            if getattr(f, "f_code", None) and f.f_code.co_filename == hostfs.__file__:  # type: ignore[attr-defined]
                stuck.append(f.f_code.co_name)  # type: ignore[attr-defined]
                break
            f = f.f_back  # type: ignore[attr-defined]
    return stuck


async def test_editor_view_of_a_fifo_fails_at_once_and_blocks_no_thread(sb: Sandbox) -> None:
    made = await sb.exec("mkfifo p && mkfifo /tmp/q && ls -l p", timeout=10)
    assert made.ok and made.stdout.startswith("p"), made.output
    tool = EditorTool(sb)
    for path in ("p", f"{sb.workspace_in_sandbox}/p", "/tmp/q"):
        res = await asyncio.wait_for(tool({"command": "view", "path": path}), 5)
        assert res.is_error and ("FIFO" in res.output or "not a regular file" in res.output), res
    # Writing through a FIFO would block just the same (open for write waits for a reader).
    for cmd in ({"command": "create", "path": "p", "file_text": "x"},
                {"command": "str_replace", "path": "p", "old_str": "a", "new_str": "b"},
                {"command": "insert", "path": "p", "insert_line": 0, "new_str": "x"}):
        res = await asyncio.wait_for(tool(cmd), 5)
        assert res.is_error, (cmd, res)
    await asyncio.sleep(0.05)
    assert _threads_inside_hostfs() == []
    # The sandbox and the editor still work afterwards.
    assert "fine" in (await asyncio.wait_for(tool({"command": "view", "path": "ok.txt"}), 5)).output


async def test_put_file_on_a_fifo_with_a_reader_neither_blocks_nor_writes(sb: Sandbox) -> None:
    made = await sb.exec("mkfifo p", timeout=10)
    assert made.ok, made.output
    host_fifo = sb.workspace / "p"
    # A reader on the host side makes a non-blocking open for writing succeed; the fstat check
    # must still refuse before any byte goes into the pipe.
    rfd = os.open(host_fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(hostfs.SpecialFileError, match="FIFO"):
            await asyncio.wait_for(sb.put_file("p", b"data"), 5)
        assert os.read(rfd, 10) == b""  # nothing went into the pipe (and no writer is left)
    finally:
        os.close(rfd)


async def test_sparse_giant_file_is_refused_not_read(sb: Sandbox) -> None:
    made = await sb.exec("truncate -s 900M big && echo ok", timeout=10)
    assert made.ok, made.output
    with pytest.raises(hostfs.FileTooLarge):
        await asyncio.wait_for(sb.get_file("big"), 5)
    res = await asyncio.wait_for(EditorTool(sb)({"command": "view", "path": "big"}), 5)
    assert res.is_error and "bytes" in res.output


async def test_links_are_not_followed_for_reads_writes_or_directory_checks(
        sb: Sandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    (tmp_path / "dir").mkdir()
    (sb.workspace / "to_file").symlink_to(secret)
    (sb.workspace / "to_dir").symlink_to(tmp_path / "dir")
    (sb.workspace / "to_dev").symlink_to("/dev/zero")
    tool = EditorTool(sb)
    for path in ("to_file", "to_dev", "to_dir/x"):
        res = await asyncio.wait_for(tool({"command": "view", "path": path}), 5)
        assert res.is_error and "host secret" not in res.output, (path, res)
    res = await asyncio.wait_for(
        tool({"command": "create", "path": "to_dir/new.txt", "file_text": "x"}), 5)
    assert res.is_error
    assert not (tmp_path / "dir" / "new.txt").exists()
    assert hostfs.kind_beneath(sb.workspace, "to_dir") == "link"
    assert hostfs.kind_beneath(sb.workspace, "ok.txt") == "file"
    assert hostfs.kind_beneath(sb.workspace, "missing") is None
    assert secret.read_text() == "host secret"


def test_copy_tree_drops_fifos_and_copies_links_as_links(tmp_path: Path) -> None:
    src, dst, outside = tmp_path / "src", tmp_path / "dst", tmp_path / "outside"
    for d in (src, dst, outside):
        d.mkdir()
    (outside / "secret").write_text("host secret")
    (src / "a.txt").write_text("a")
    os.mkfifo(src / "pipe")
    (src / "link").symlink_to(outside / "secret")
    (src / "dirlink").symlink_to(outside)
    copied = hostfs.copy_tree(src, dst)
    assert copied == 1
    assert sorted(p.name for p in dst.iterdir()) == ["a.txt", "dirlink", "link"]
    assert (dst / "link").is_symlink() and (dst / "dirlink").is_symlink()
    assert not (outside / "pipe").exists() and list(outside.iterdir()) == [outside / "secret"]
    # The fd-level check that guards the copy: a FIFO is refused without blocking.
    dfd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(hostfs.SpecialFileError):
            hostfs._open_regular(dfd, "pipe", "pipe", os.O_RDONLY)
    finally:
        os.close(dfd)
