"""A damaged write-ahead log is refused before SQLite replays it (and silently drops the
committed jobs behind the damage); with ``drop_damaged_wal`` the server starts without the
damaged tail and names the jobs it dropped."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
import struct
import sys
from pathlib import Path

import pytest

from rollout.runtime.types import JobSpec
from rollout.server.store import JobStore, StoreFileError, check_store_file
from rollout.server.store import wal as walmod

pytestmark = pytest.mark.timeout(60)
JOBS = 300


async def _crashed_store(tmp: Path) -> Path:
    """A state directory as a SIGKILLed server leaves it: 300 jobs answered ``accepted`` (each
    committed in its own transaction) whose pages are still only in the WAL."""
    live = tmp / "live"
    store = JobStore(live / "jobs.sqlite3")
    await store.open()
    try:
        for i in range(JOBS):
            await store.insert_jobs([(JobSpec(job_id=f"job-{i}", environment="scripted",
                                              task={"n": i}), "tenant")], 1.0)
        await store.flush()
        state = tmp / "state"
        state.mkdir()
        for name in ("jobs.sqlite3", "jobs.sqlite3-wal"):  # copied while open: no checkpoint
            shutil.copyfile(live / name, state / name)
    finally:
        await store.close()
    return state / "jobs.sqlite3"


def _frame_size(db: Path) -> int:
    return walmod.FRAME_HEADER + walmod.page_size_of(db)


def _flip_first_frame(db: Path, wal: bytearray) -> None:
    wal[walmod.HEADER + walmod.FRAME_HEADER + 100] ^= 0x40


def _garbage_header(db: Path, wal: bytearray) -> None:
    wal[:walmod.HEADER] = b"\xa5" * walmod.HEADER


def _bad_middle_frame(db: Path, wal: bytearray) -> None:
    frames = (len(wal) - walmod.HEADER) // _frame_size(db)
    at = walmod.HEADER + (frames // 2) * _frame_size(db)
    wal[at + walmod.FRAME_HEADER + 7] ^= 0x01


def _cut_in_half(db: Path, wal: bytearray) -> None:
    del wal[len(wal) // 2:]


def _jobs_sqlite_sees(db: Path) -> int:
    copy = db.parent.parent / "probe"
    copy.mkdir(exist_ok=True)
    for name in ("jobs.sqlite3", "jobs.sqlite3-wal"):
        shutil.copyfile(db.parent / name, copy / name)
    conn = sqlite3.connect(copy / "jobs.sqlite3")
    try:
        return int(conn.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])
    finally:
        conn.close()
        shutil.rmtree(copy)


DAMAGE = {"flipped byte in the first frame": _flip_first_frame,
          "garbage header": _garbage_header, "bad middle frame": _bad_middle_frame,
          "WAL cut in half": _cut_in_half}


async def test_a_sound_wal_opens_with_every_job(tmp_path: Path) -> None:
    db = await _crashed_store(tmp_path)
    assert not walmod.check((db.parent / "jobs.sqlite3-wal").read_bytes()).damaged
    store = JobStore(db)
    await store.open()
    try:
        assert all([await store.get(f"job-{i}") is not None for i in (0, JOBS // 2, JOBS - 1)])
    finally:
        await store.close()


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
async def test_a_damaged_wal_is_refused_and_with_the_flag_its_dropped_jobs_are_named(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    db = await _crashed_store(tmp_path)
    wal_path = db.parent / "jobs.sqlite3-wal"
    wal = bytearray(wal_path.read_bytes())
    DAMAGE[damage](db, wal)
    wal_path.write_bytes(bytes(wal))
    # What SQLite alone does with it: starts, says nothing, and committed jobs are gone.
    assert _jobs_sqlite_sees(db) < JOBS
    store = JobStore(db)
    with pytest.raises(StoreFileError) as info:
        await store.open()
    await store.close()
    assert info.value.reason == "STORE_WAL_DAMAGED"
    assert "--drop-damaged-wal" in str(info.value)
    assert wal_path.read_bytes() == bytes(wal)  # a refused start changes nothing
    caplog.set_level(logging.WARNING, logger="rollout.server.store.file")
    await asyncio.to_thread(check_store_file, db, drop_damaged_wal=True)
    line = next(r.getMessage() for r in caplog.records if "STORE_WAL_DAMAGED" in r.getMessage())
    assert "frame(s)" in line
    kept = _jobs_sqlite_sees(db)
    if damage != "WAL cut in half":  # the frames past a cut are gone: nothing to name
        assert f"holding {JOBS - kept} job(s)" in line, line
        assert f"job-{kept}," in line, line  # the first job the damaged tail held
    assert list(db.parent.glob("jobs.sqlite3-wal.damaged-*"))
    store = JobStore(db)
    await store.open()  # now starts, without the damaged tail
    await store.close()


def test_left_overs_of_an_earlier_round_are_not_damage() -> None:
    """SQLite reuses the log after a checkpoint: frames with the old salts after the new ones
    are ignored by SQLite and must not be reported."""
    page = 512

    def frame(salts: tuple[int, int], seed: tuple[int, int], commit: int
              ) -> tuple[bytes, tuple[int, int]]:
        head = struct.pack(">2I", 1, commit)
        data = bytes(range(256)) * 2
        k = walmod._checksum(head + data, *seed, False)
        return head + struct.pack(">4I", *salts, *k) + data, k

    def log(salts: tuple[int, int], frames: int) -> bytes:
        head = struct.pack(">6I", walmod.MAGIC[0], walmod.VERSION, page, 0, *salts)
        seed = walmod._checksum(head, 0, 0, False)
        out = head + struct.pack(">2I", *seed)
        for _ in range(frames):
            f, seed = frame(salts, seed, 1)
            out += f
        return out

    old = log((1, 7), 4)
    new = log((2, 9), 2)
    reused = new + old[len(new):]
    verdict = walmod.check(reused)
    assert not verdict.damaged and verdict.good_bytes == len(new)
    sound = log((2, 9), 3)
    broken = sound[:40] + bytes([sound[40] ^ 1]) + sound[41:]  # frame 1's salt
    assert walmod.check(broken).damaged


async def test_rollout_serve_refuses_a_damaged_wal_in_one_line(tmp_path: Path) -> None:
    db = await _crashed_store(tmp_path)
    wal_path = db.parent / "jobs.sqlite3-wal"
    wal = bytearray(wal_path.read_bytes())
    _flip_first_frame(db, wal)
    wal_path.write_bytes(bytes(wal))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.entrypoints.cli", "serve", "--state-dir",
        str(db.parent), "--port", "0", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 40)
    text = (out + err).decode()
    assert proc.returncode == 2, text
    assert "STORE_WAL_DAMAGED" in text and "Traceback" not in text
    assert len(text.strip().splitlines()) == 1, text
