"""A corrupt, foreign, empty or too-new store file is refused at start with a clear message."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import grpc
import pytest

from rollout.server.store import JobStore, StoreFileError
from rollout.server.store.file import APPLICATION_ID

pytestmark = pytest.mark.timeout(30)


def _header_app_id(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA application_id").fetchone()[0])
    finally:
        conn.close()


async def _open(path: Path) -> StoreFileError:
    store = JobStore(path)
    with pytest.raises(StoreFileError) as info:
        await store.open()
    await store.close()
    err = info.value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(path) in str(err) and err.field == "server.state_dir"
    return err


async def test_new_store_is_stamped_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    await store.open()
    await store.close()
    assert _header_app_id(path) == APPLICATION_ID
    again = JobStore(path)
    await again.open()
    await again.close()


async def test_store_from_before_the_stamp_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA application_id=0")
    conn.commit()
    conn.close()
    assert _header_app_id(path) == 0
    store = JobStore(path)
    await store.open()
    await store.close()
    assert _header_app_id(path) == APPLICATION_ID


async def test_empty_file_is_not_silently_started(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    path.touch()
    err = await _open(path)
    assert err.reason == "STORE_FILE_EMPTY" and "empty" in str(err)
    assert path.stat().st_size == 0  # left as it was


async def test_garbage_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    data = os.urandom(8192)
    path.write_bytes(data)
    err = await _open(path)
    assert err.reason == "STORE_FILE_CORRUPT" and "not an SQLite database" in str(err)
    assert path.read_bytes() == data


async def test_damaged_pages_after_a_sane_header_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    await store.open()
    await store.close()
    for extra in ("-wal", "-shm"):
        Path(f"{path}{extra}").unlink(missing_ok=True)
    raw = bytearray(path.read_bytes())
    raw[100:] = b"\xa5" * (len(raw) - 100)  # keep the header, wreck every page
    path.write_bytes(bytes(raw))
    err = await _open(path)
    assert err.reason == "STORE_FILE_CORRUPT"


async def _store_with_damaged_middle_pages(path: Path) -> None:
    """A store with rows whose header, schema page and first pages are intact but a few pages
    in the middle are overwritten (a disk error): it opens, and fails only when read."""
    from rollout.runtime.types import JobSpec

    store = JobStore(path)
    await store.open()
    await store.insert_jobs([(JobSpec(job_id=f"job-{i}", environment="echo",
                                      task={"prompt": "x" * 400}), "trainer")
                             for i in range(300)], 1.0)
    await store.close()
    for extra in ("-wal", "-shm"):
        Path(f"{path}{extra}").unlink(missing_ok=True)
    raw = bytearray(path.read_bytes())
    page = 4096
    middle = len(raw) // page // 2
    assert middle > 4
    raw[middle * page:(middle + 2) * page] = b"\xa5" * (2 * page)
    path.write_bytes(bytes(raw))


async def test_damaged_middle_pages_are_refused_at_open(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    await _store_with_damaged_middle_pages(path)
    before = path.read_bytes()
    err = await _open(path)
    assert err.reason == "STORE_FILE_CORRUPT" and "damaged" in str(err)
    assert "\n" not in str(err)
    assert path.read_bytes() == before  # refused, not repaired or overwritten


async def test_another_applications_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE invoices (id INTEGER)")
    conn.commit()
    conn.close()
    err = await _open(path)
    assert err.reason == "STORE_FILE_FOREIGN" and "invoices" in str(err)
    conn = sqlite3.connect(path)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["invoices"]
    conn.close()

    other = tmp_path / "other.sqlite3"
    conn = sqlite3.connect(other)
    conn.execute("PRAGMA application_id=1234")
    conn.execute("CREATE TABLE jobs (x)")
    conn.commit()
    conn.close()
    err = await _open(other)
    assert err.reason == "STORE_FILE_FOREIGN" and "0x4d2" in str(err)


async def test_store_from_a_newer_release_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = JobStore(path)
    await store.open()
    await store.close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=7")
    conn.commit()
    conn.close()
    err = await _open(path)
    assert err.reason == "STORE_FILE_TOO_NEW"


@pytest.mark.parametrize("content, reason", [(b"", "STORE_FILE_EMPTY"),
                                             (b"not a database " * 100, "STORE_FILE_CORRUPT"),
                                             (None, "STORE_FILE_CORRUPT")])
async def test_rollout_serve_refuses_before_loading_a_model(tmp_path: Path,
                                                            content: bytes | None,
                                                            reason: str) -> None:
    """The default configuration loads SmolLM2 first; the store is checked before that, so
    the operator hears about it in seconds, as one line, exit status 2 and no traceback.
    ``None``: a real store with damaged pages in the middle (a sane header and schema)."""
    import asyncio
    import sys

    state = tmp_path / "state"
    state.mkdir()
    if content is None:
        await _store_with_damaged_middle_pages(state / "jobs.sqlite3")
        content = (state / "jobs.sqlite3").read_bytes()
    else:
        (state / "jobs.sqlite3").write_bytes(content)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir", str(state),
        "--port", "0", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 25)
    text = (out + err).decode()
    assert proc.returncode == 2, text
    assert reason in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1, text
    assert (state / "jobs.sqlite3").read_bytes() == content
