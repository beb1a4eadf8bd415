"""The shared head+tail output cap, as ``exec`` and the bash tool configure it."""

from __future__ import annotations

from rollout.runtime.sandbox.output import CappedOutput
from rollout.runtime.tools.bash import _new_sink


def test_split_keeps_head_and_tail_and_counts_the_middle() -> None:
    buf = CappedOutput.split(5)  # 2 head + 3 tail
    for chunk in (b"ab", b"cdefg", b"hij"):
        buf.feed(chunk)
    assert (bytes(buf.head), bytes(buf.tail), buf.dropped) == (b"ab", b"hij", 5)
    assert buf.text() == "ab\n[... 5 bytes of output truncated ...]\nhij"


def test_under_the_cap_is_unchanged_and_multibyte_survives_a_split_read() -> None:
    buf = CappedOutput.split(100)
    data = "héllo".encode()
    buf.feed(data[:2])
    buf.feed(data[2:])
    assert buf.text() == "héllo" and buf.dropped == 0


def test_bash_sink_uses_equal_halves_and_its_own_notice() -> None:
    sink = _new_sink(5)  # 2 head + 2 tail
    sink.feed(b"abcdefg")
    assert sink.dropped == 3
    assert sink.text() == ("ab\n[... 3 bytes of output truncated; redirect to a file and view "
                           "parts of it to see more ...]\nfg")
    tiny = _new_sink(0)  # never below one byte each side
    tiny.feed(b"xyz")
    assert (bytes(tiny.head), bytes(tiny.tail), tiny.dropped) == (b"x", b"z", 1)
