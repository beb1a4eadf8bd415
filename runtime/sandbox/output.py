"""The head+tail capped output buffer shared by ``exec`` and the bash tool.

Why head and tail: the start of an output says what a command was doing and the end says how
it finished (errors, summaries); the middle is what a flood of log lines costs. Bytes are kept
undecoded until :meth:`CappedOutput.text`, so a multi-byte character split across two reads
still decodes. No imports, so the bash tool can use it without pulling in a sandbox runtime.
"""

from __future__ import annotations

TRUNCATION_NOTICE = "[... {dropped} bytes of output truncated ...]"
"""Default marker put between head and tail; ``{dropped}`` is the number of bytes left out."""


class CappedOutput:
    """Keeps the first ``head_limit`` and the last ``tail_limit`` bytes of a stream; drops
    (and counts) the middle."""

    def __init__(self, head_limit: int, tail_limit: int,
                 notice: str = TRUNCATION_NOTICE) -> None:
        self.head_limit = head_limit
        self.tail_limit = tail_limit
        self.notice = notice
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    @classmethod
    def split(cls, limit: int, notice: str = TRUNCATION_NOTICE) -> CappedOutput:
        """A buffer of ``limit`` bytes in all: half head, the rest tail."""
        head = limit // 2
        return cls(head, limit - head, notice)

    def feed(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            extra = len(self.tail) - self.tail_limit
            if extra > 0:
                del self.tail[:extra]
                self.dropped += extra

    def text(self) -> str:
        """Head and tail decoded, with the notice between them when anything was dropped."""
        head = self.head.decode("utf-8", "backslashreplace")
        tail = self.tail.decode("utf-8", "backslashreplace")
        if self.dropped:
            return f"{head}\n{self.notice.format(dropped=self.dropped)}\n{tail}"
        return head + tail
