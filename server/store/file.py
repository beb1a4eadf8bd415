"""Refuse a job-store file that is not ours before SQLite touches it.

Started on a corrupt file, SQLite fails deep in the writer thread with a raw traceback; started
on another program's database, it would add our tables beside theirs; started on an empty file
(a truncated store), it would silently begin a new store and every unacknowledged trajectory
would be gone. Each case is refused with a message that says what is wrong and what to do.

Damage past the first page (a disk error, a partial copy, a file edited in place) leaves a
sane header and schema, so SQLite would only fail once the scheduler reads the damaged rows,
as a traceback. ``PRAGMA quick_check`` reads every page at open instead (one pass over the
file before any model loads) and the server refuses to start with one line.

A store is recognised by SQLite's header, then by ``PRAGMA application_id`` (stamped on every
store this service opens; stores from before the stamp have 0 and are recognised by their
tables), and ``PRAGMA user_version`` must not be newer than this release knows.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

from rollout.server.api.errors import FailedPrecondition
from rollout.server.store import wal

log = logging.getLogger(__name__)

STORE_FILE = "jobs.sqlite3"
"""The job store's name inside the state directory."""
SQLITE_HEADER = b"SQLite format 3\x00"
APPLICATION_ID = 0x524F4C4F
"""``PRAGMA application_id`` of a Rollout Service job store ("ROLO")."""
KNOWN_USER_VERSION = 0
"""Highest ``PRAGMA user_version`` this release reads (the schema is migrated by columns, so
user_version is not used yet; a store that sets it comes from a newer release)."""


_OUR_TABLES = {"jobs", "transitions", "deliveries", "delivery_marks", "closed_groups"}
"""Tables an unstamped store of ours has at least one of (older releases had fewer)."""


class StoreFileError(FailedPrecondition):
    default_reason = "STORE_FILE_INVALID"


def check_store_file(path: Path, *, drop_damaged_wal: bool = False) -> bool:
    """Raise :class:`StoreFileError` unless ``path`` is absent or a job store of ours (its
    write-ahead log checked first: :func:`check_wal`). Returns whether the file still needs
    the application_id stamp (new or older store)."""
    if not path.exists():
        return True
    check_wal(path, drop_damaged=drop_damaged_wal)
    what = f"the job store {path}"
    fix = ("Move it out of the state directory (or point server.state_dir elsewhere) and "
           "start again; restore it from a backup if it held unacknowledged results")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(100)
    except OSError as e:
        raise StoreFileError(f"cannot read {what}: {e.strerror}", "STORE_FILE_UNREADABLE",
                             "server.state_dir") from None
    if size == 0:
        raise StoreFileError(f"{what} is an empty file (truncated, or not written by this "
                             f"service); refusing to start a new store over it. {fix}.",
                             "STORE_FILE_EMPTY", "server.state_dir")
    if not head.startswith(SQLITE_HEADER) or len(head) < 100:
        raise StoreFileError(f"{what} is not an SQLite database (corrupt, or another kind of "
                             f"file). {fix}.", "STORE_FILE_CORRUPT", "server.state_dir")
    # Through SQLite, not the header bytes: in WAL mode a recent PRAGMA may sit in the -wal.
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            user_version = conn.execute("PRAGMA user_version").fetchone()[0]
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
            problems = [line.strip() for r in conn.execute("PRAGMA quick_check(3)")
                        for line in str(r[0]).splitlines()
                        if line.strip() and not line.startswith("***")]
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise StoreFileError(f"{what} is damaged ({e}). {fix}.", "STORE_FILE_CORRUPT",
                             "server.state_dir") from None
    if problems != ["ok"]:
        raise StoreFileError(f"{what} has damaged pages ({'; '.join(problems)[:200]}). "
                             f"{fix}.", "STORE_FILE_CORRUPT", "server.state_dir")
    if app_id not in (0, APPLICATION_ID):
        raise StoreFileError(f"{what} belongs to another application (application_id "
                             f"{app_id:#x}, ours is {APPLICATION_ID:#x}). {fix}.",
                             "STORE_FILE_FOREIGN", "server.state_dir")
    if user_version > KNOWN_USER_VERSION:
        raise StoreFileError(f"{what} was written by a newer release (format {user_version}; "
                             f"this one reads up to {KNOWN_USER_VERSION}): upgrade the server",
                             "STORE_FILE_TOO_NEW", "server.state_dir")
    if app_id == APPLICATION_ID:
        return False
    if tables and not tables & _OUR_TABLES:
        raise StoreFileError(f"{what} is another application's SQLite database (tables "
                             f"{sorted(tables)[:5]}). {fix}.", "STORE_FILE_FOREIGN",
                             "server.state_dir")
    return True


def damaged(path: Path, exc: sqlite3.DatabaseError) -> StoreFileError:
    """What SQLite's own failure to open a store (past a sane header) is reported as."""
    return StoreFileError(f"the job store {path} is damaged ({exc}): move it out of the state "
                          "directory and start again, or restore it from a backup",
                          "STORE_FILE_CORRUPT", "server.state_dir")


def check_wal(path: Path, *, drop_damaged: bool = False) -> None:
    """Refuse (``STORE_WAL_DAMAGED``) a write-ahead log whose replay would silently drop
    committed transactions, before SQLite replays it; with ``drop_damaged`` (the operator's
    ``store.drop_damaged_wal``) cut the log to its replayable prefix instead and log, in one
    line, how many frames and which job ids were dropped (``server/store/wal.py``)."""
    wal_path = Path(f"{path}-wal")
    try:
        if not path.exists() or not wal_path.exists() or wal_path.stat().st_size == 0:
            return
        verdict = wal.check(wal_path.read_bytes())
    except OSError as e:
        raise StoreFileError(f"cannot read the job store's write-ahead log {wal_path}: "
                             f"{e.strerror}", "STORE_FILE_UNREADABLE", "server.state_dir"
                             ) from None
    if not verdict.damaged:
        return
    if not drop_damaged:
        raise StoreFileError(
            f"the job store's write-ahead log {wal_path} is damaged: {verdict.damaged}; "
            f"replaying it would silently drop {verdict.dropped_frames} frame(s) of committed "
            "jobs. Restore the state directory from a backup, or start once with "
            "--drop-damaged-wal (store.drop_damaged_wal = true) to start without the damaged "
            "tail (the server then names the job ids it dropped)", "STORE_WAL_DAMAGED",
            "store.drop_damaged_wal")
    dropped = wal.drop_damaged_tail(path, verdict)
    named = (", ".join(dropped.jobs[:50]) + (" ..." if len(dropped.jobs) > 50 else "")
             if dropped.jobs else "none")
    log.warning("STORE_WAL_DAMAGED: started without the damaged tail of %s (%s): dropped %d "
                "frame(s) holding %s job(s): %s; the whole log is kept at %s", wal_path,
                verdict.damaged, dropped.frames,
                "unknown" if dropped.jobs is None else len(dropped.jobs),
                named if dropped.jobs is not None else "(the damaged frames cannot be read)",
                dropped.kept_at)
