"""The controller's typed records of a switch under way (control/timeline.py): a drain's or a move's timeline
fills in its run event point by point, and the controller's logic reads its fields, not the event's keys."""

from __future__ import annotations

import itertools

import pytest

from orchestrator.control.timeline import SwitchTimeline

pytestmark = pytest.mark.unit


def clock(*times: float):
    it = iter(times)
    return lambda: next(it)


def test_a_staged_drain_counts_no_step_of_the_doomed_nodes_as_resumed_or_first():
    event = {"kind": "drain", "deadline_s": 10.0}
    t = SwitchTimeline(event, deadline_s=10.0)
    never = clock()  # reading the clock for a point that is not marked would raise StopIteration
    assert not t.mark("staged_s", clock(2.0))
    assert not t.mark("resumed_s", never) and not t.mark("first_step_s", never)  # the doomed nodes still train
    assert not t.mark("switch_s", clock(6.0)) and not t.mark("snapshot_s", clock(6.5))
    assert not t.mark("switch_s", never)  # a point is marked once
    assert not t.mark("resumed_s", clock(7.25))
    assert t.mark("first_step_s", clock(8.0))  # the new plan's first step closes it
    assert event == {"kind": "drain", "deadline_s": 10.0, "staged_s": 2.0, "switch_s": 6.0, "snapshot_s": 6.5,
                     "resumed_s": 7.25, "first_step_s": 8.0, "stall_s": 1.25, "met_deadline": True}
    assert (t.stall_s, t.first_step_s) == (1.25, 8.0)


def test_a_snapshot_after_the_deadline_misses_it_and_a_move_has_no_deadline_to_meet():
    late = SwitchTimeline({"kind": "drain"}, deadline_s=5.0)
    ticks = itertools.count(5.0)  # the snapshot lands at 6 s, past the 5 s deadline
    for point in ("switch_s", "snapshot_s", "resumed_s"):
        late.mark(point, lambda: float(next(ticks)))
    assert late.mark("first_step_s", clock(9.0)) and late.event["met_deadline"] is False
    move = SwitchTimeline({"kind": "scale-up"})
    move.mark("switch_s", clock(1.0))
    assert move.mark("first_step_s", clock(2.0)) and "met_deadline" not in move.event


def test_a_switch_that_ends_without_a_step_on_its_plan_says_why_and_whether_it_met_its_deadline():
    staged = SwitchTimeline({"kind": "drain"}, deadline_s=5.0)
    staged.mark("staged_s", clock(1.0))
    staged.end("the job ended before the switch")
    assert staged.event == {"kind": "drain", "staged_s": 1.0, "first_step_s": None, "met_deadline": True,
                            "ended": "the job ended before the switch"}  # the doomed nodes were never left
    cut = SwitchTimeline({"kind": "drain"}, deadline_s=5.0)
    cut.mark("switch_s", clock(4.0))
    cut.end("the job failed")
    assert cut.event["met_deadline"] is False  # switched, and the state never got out


def test_an_unknown_point_is_refused():
    with pytest.raises(ValueError, match="no point 'switched'"):
        SwitchTimeline({}).mark("switched", clock(1.0))
