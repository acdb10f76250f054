"""Completion markers: a board word reports its hand-off once the prefill side wrote its value (or value
+ 1 for a packed one), exactly once; a disarmed word's late marker never matches the word's next
hand-off; sources lend registered words holding the values while a write runs, and say when none are
left (the notice goes instead)."""

from __future__ import annotations

import ctypes

from deltamoe.serve.kv_transfer.markers import MARKER_BYTES, MarkerBoard, MarkerSources


def write(segments) -> None:
    """What the transfer engine does with a marker segment: copy its 8 bytes to the destination."""
    for s in segments:
        ctypes.memmove(s.dst, s.src, s.nbytes)


def test_a_marker_reports_its_handoff_once_and_says_packed_or_not():
    board, sources = MarkerBoard(words=4), MarkerSources(words=4)
    a, b = board.arm("a"), board.arm("b")
    assert a[1] != b[1] and board.arrived() == []  # armed words start at zero: nothing in yet
    with sources.segments([a], packed=False) as segments:
        write(segments)
    with sources.segments([b], packed=True) as segments:
        write(segments)
    assert sorted(board.arrived()) == ["a unpacked", "b packed"]
    assert board.arrived() == []  # reported once; the words are free again


def test_a_late_marker_in_a_reused_word_does_not_match_its_next_handoff():
    board, sources = MarkerBoard(words=1), MarkerSources(words=1)
    first = board.arm("first")
    assert board.arm("other") is None  # every word armed: that hand-off waits for the notice or the answer
    board.disarm(first[0])  # ended another way (the answer came first)
    second = board.arm("second")
    assert second[0] == first[0] and second[1] != first[1]
    with sources.segments([first], packed=True) as segments:  # the first hand-off's marker, late
        write(segments)
    assert board.arrived() == []
    with sources.segments([second], packed=False) as segments:
        write(segments)
    assert board.arrived() == ["second unpacked"]


def test_sources_lend_words_while_a_write_runs_and_none_beyond_them():
    sources = MarkerSources(words=2)
    with sources.segments([(1000, 2), (2000, 4)], packed=False) as held:
        assert [s.dst for s in held] == [1000, 2000] and all(s.nbytes == MARKER_BYTES for s in held)
        assert [ctypes.c_int64.from_address(s.src).value for s in held] == [2, 4]
        with sources.segments([(3000, 6)], packed=False) as none_left:
            assert none_left is None
    with sources.segments([(3000, 6)], packed=True) as again:
        assert ctypes.c_int64.from_address(again[0].src).value == 7
