"""Check the job store's write-ahead log before SQLite replays it.

Why: SQLite replays a WAL frame by frame and stops, without a word, at the first frame whose
salt or cumulative checksum is wrong; every transaction after it is dropped. That is right for
the torn tail of a transaction that never committed, and silently wrong when one damaged byte
sits in front of transactions that did commit: a flipped byte in the first frame, and every job
the server had answered ``accepted`` is gone at the next start. So the log is read here first
(SQLite's documented format: a 32-byte header, then frames of a 24-byte header and one page,
each frame's checksum seeded by the previous one's), and damage that would drop committed
transactions is refused in one line (``STORE_WAL_DAMAGED``). With the operator's explicit
``store.drop_damaged_wal`` the server starts without the damaged tail instead, saying how many
frames it dropped and which job ids those frames held.

What counts as damage (``check``):
- a header that is not a WAL header (magic, version, header checksum) in front of frames;
- a frame with the log's salts that fails its checksum while a later frame with those salts is
  a valid commit frame (checked against the previous frame's stored checksum, so a frame after
  the damage can still be verified on its own);
- a log that ends inside a frame (the file was cut: SQLite writes whole frames).
Frames with other salts are left-overs of an earlier round of the log (SQLite reuses the file
after a checkpoint) and are ignored, as SQLite ignores them. Not detectable: a log cut exactly
at a frame boundary.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import struct
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = (0x377F0682, 0x377F0683)
"""Little-endian and big-endian checksums (the low bit of the magic says which)."""
VERSION = 3007000
HEADER = 32
FRAME_HEADER = 24


@dataclass(frozen=True)
class WalVerdict:
    """What the log holds: ``damaged`` (why, "" when sound), the frames SQLite would replay
    (``good_bytes``: the log's length up to and including its last valid commit frame) and the
    frames after them (``dropped_frames``)."""

    damaged: str
    good_bytes: int
    dropped_frames: int
    page_size: int = 0


def _checksum(data: bytes, s0: int, s1: int, big: bool) -> tuple[int, int]:
    words = struct.unpack(f"{'>' if big else '<'}{len(data) // 4}I", data)
    mask = 0xFFFFFFFF
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & mask
        s1 = (s1 + words[i + 1] + s0) & mask
    return s0, s1


def check(wal: bytes) -> WalVerdict:
    """Read a WAL image and say whether replaying it would drop committed transactions."""
    if len(wal) <= HEADER:
        return WalVerdict("", len(wal), 0)
    magic, version, page_size, _, salt1, salt2, c1, c2 = struct.unpack(">8I", wal[:HEADER])
    big = magic == MAGIC[1]
    sane = (magic in MAGIC and version == VERSION and page_size >= 512
            and page_size & (page_size - 1) == 0 and page_size <= 65536
            and _checksum(wal[:24], 0, 0, big) == (c1, c2))
    if not sane:
        if not any(wal[HEADER:]):
            return WalVerdict("", len(wal), 0)
        return WalVerdict("its header is not a write-ahead-log header (garbage or damaged), "
                          "so SQLite would ignore every frame after it", HEADER,
                          _frames_in(wal, 0))
    frame = FRAME_HEADER + page_size
    count = (len(wal) - HEADER) // frame
    cut = (len(wal) - HEADER) % frame
    seed = (c1, c2)
    good_end = HEADER
    first_bad = -1
    last_commit_after_bad = -1
    replay = True
    for i in range(count):
        at = HEADER + i * frame
        head = wal[at:at + FRAME_HEADER]
        _, commit, fs1, fs2, k1, k2 = struct.unpack(">6I", head)
        local = (fs1, fs2) == (salt1, salt2) and _checksum(
            head[:8] + wal[at + FRAME_HEADER:at + frame], *seed, big) == (k1, k2)
        seed = (k1, k2)  # the next frame is checked against what this one says, right or not
        if replay and local:
            if commit:
                good_end = at + frame
            continue
        if replay:
            # SQLite stops here: left-overs of an earlier round (other salts, rightly
            # ignored), a torn uncommitted tail, or damage (decided by what follows).
            replay, first_bad = False, i
        elif local and commit:
            last_commit_after_bad = i
    dropped = max(0, count - (good_end - HEADER) // frame)
    if first_bad >= 0 and last_commit_after_bad >= 0:
        return WalVerdict(f"frame {first_bad + 1} of {count} fails its checksum and committed "
                          f"transactions follow it (through frame {last_commit_after_bad + 1})",
                          good_end, dropped, page_size)
    if cut:
        return WalVerdict(f"it ends {cut} bytes into frame {count + 1} (the file was cut: "
                          "SQLite writes whole frames)", good_end, dropped + 1, page_size)
    return WalVerdict("", good_end, 0, page_size)


def _frames_in(wal: bytes, page_size: int) -> int:
    """Frames a log with an unreadable header held: its page size is taken from the most common
    frame stride that fits (every SQLite page size is a power of two)."""
    body = len(wal) - HEADER
    for size in (page_size, 4096, 1024, 2048, 8192, 16384, 32768, 65536, 512):
        if size and body % (FRAME_HEADER + size) == 0:
            return body // (FRAME_HEADER + size)
    return max(1, body // (FRAME_HEADER + 4096))


def _salts_of_frames(wal: bytes, page_size: int) -> tuple[int, int] | None:
    frame = FRAME_HEADER + page_size
    salts = Counter(struct.unpack(">2I", wal[at + 8:at + 16])
                    for at in range(HEADER, len(wal) - frame + 1, frame))
    return salts.most_common(1)[0][0] if salts else None


def _repaired(wal: bytes, page_size: int) -> bytes:
    """The log as if nothing were damaged: the header rebuilt from the frames' salts and every
    frame with those salts re-checksummed, so SQLite replays all of it (to name what the
    damaged tail held)."""
    big = False
    salts = _salts_of_frames(wal, page_size)
    if salts is None:
        return wal[:HEADER]
    head = struct.pack(">6I", MAGIC[0], VERSION, page_size, 0, *salts)
    seed = _checksum(head, 0, 0, big)
    out = bytearray(head + struct.pack(">2I", *seed))
    frame = FRAME_HEADER + page_size
    for at in range(HEADER, len(wal) - frame + 1, frame):
        fh = bytearray(wal[at:at + FRAME_HEADER])
        if struct.unpack(">2I", fh[8:16]) != salts:
            break
        page = wal[at + FRAME_HEADER:at + frame]
        seed = _checksum(bytes(fh[:8]) + page, *seed, big)
        fh[16:24] = struct.pack(">2I", *seed)
        out += fh + page
    return bytes(out)


def _job_ids(db: Path, wal: bytes) -> set[str] | None:
    """Job ids a copy of the store sees with ``wal`` as its log (None: unreadable)."""
    with tempfile.TemporaryDirectory(prefix="rollout-wal-") as tmp:
        copy = Path(tmp) / "jobs.sqlite3"
        shutil.copyfile(db, copy)
        Path(f"{copy}-wal").write_bytes(wal)
        try:
            conn = sqlite3.connect(copy)
            try:
                return {str(r[0]) for r in conn.execute("SELECT job_id FROM jobs")}
            finally:
                conn.close()
        except sqlite3.DatabaseError:
            return None


def page_size_of(db: Path) -> int:
    with open(db, "rb") as f:
        head = f.read(18)
    size = int.from_bytes(head[16:18], "big") if len(head) == 18 else 4096
    return 65536 if size == 1 else (size or 4096)


@dataclass(frozen=True)
class Dropped:
    """What starting without a damaged tail gave up: frames and the job ids they held
    (``None``: the damaged frames could not be read to name them)."""

    frames: int
    jobs: list[str] | None
    kept_at: Path


def drop_damaged_tail(db: Path, verdict: WalVerdict) -> Dropped:
    """Keep the log's replayable prefix only; the whole damaged log is kept beside the store
    (``<store>-wal.damaged-<time>``) for forensics. Returns what was dropped."""
    wal_path = Path(f"{db}-wal")
    wal = wal_path.read_bytes()
    page_size = verdict.page_size or page_size_of(db)
    before = _job_ids(db, wal[:verdict.good_bytes])
    after = _job_ids(db, _repaired(wal, page_size))
    jobs = sorted(after - before) if before is not None and after is not None else None
    kept = wal_path.with_name(f"{wal_path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    shutil.copyfile(wal_path, kept)
    with open(wal_path, "r+b") as f:
        f.truncate(verdict.good_bytes if verdict.good_bytes > HEADER else 0)
    return Dropped(verdict.dropped_frames, jobs, kept)
