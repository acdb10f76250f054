"""`BusyTime`: the union of hand-off intervals, each shared second counted once."""

from __future__ import annotations

import pytest

from deltamoe.serve.kv_transfer.busy_time import BusyTime


def test_overlapping_intervals_count_their_union_once():
    busy = BusyTime(horizon_s=100.0)
    busy.add(0.0, 2.0)
    busy.add(1.0, 3.0)  # overlaps the first: +1
    busy.add(5.0, 6.0)  # disjoint: +1
    assert busy.seconds() == pytest.approx(4.0)
    busy.add(2.5, 7.0)  # bridges [1, 3] and [5, 6]: the union is [0, 7]
    assert busy.seconds() == pytest.approx(7.0)
    busy.add(4.0, 4.5)  # inside it: nothing new
    assert busy.seconds() == pytest.approx(7.0)


def test_intervals_past_the_horizon_are_settled_and_still_counted():
    busy = BusyTime(horizon_s=1.0)
    busy.add(0.0, 1.0)
    busy.add(10.0, 11.0)  # the first is settled: no later hand-off can overlap it
    assert busy._open == [(10.0, 11.0)] and busy.seconds() == pytest.approx(2.0)
    busy.add(10.5, 12.0)
    assert busy.seconds() == pytest.approx(3.0)
    with pytest.raises(ValueError):
        busy.add(3.0, 2.0)
