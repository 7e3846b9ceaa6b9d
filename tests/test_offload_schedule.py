"""The offload priority schedule: consumers never wait on a late prefetch, overlap across iterations, each copy once."""

import collections

import pytest

from workers.offload_schedule import StageTimes, makespan, schedule

pytestmark = pytest.mark.unit
T = StageTimes(fwd_s=1.0, bwd_s=2.0, h2d_s=0.8, d2h_s=0.8, adam_s=1.5)
POLICIES = [(True, False), (True, True), (False, True)]


@pytest.mark.parametrize("opt,params", POLICIES)
def test_every_transfer_once_and_consumers_after_producers(opt, params):
    ops = schedule(6, T, opt, params, prefetch_depth=1, iterations=3)
    counts = collections.Counter((o.kind, o.layer, o.iteration) for o in ops)
    assert all(n == 1 for n in counts.values())
    end = {(o.kind, o.layer, o.iteration): o.end_s for o in ops}
    start = {(o.kind, o.layer, o.iteration): o.start_s for o in ops}
    for (kind, layer, i), s in start.items():
        if kind == "fwd" and params:
            assert end[("h2d_fwd", layer, i)] <= s  # no prefetch later than its consumer
        if kind == "bwd" and params:
            assert end[("h2d_bwd", layer, i)] <= s
        if kind == "fwd" and opt and not params and i > 0:
            assert end[("h2d_update", layer, i - 1)] <= s
        if kind == "adam":
            assert end[("d2h_grad", layer, i)] <= s and end[("bwd", layer, i)] <= s
    for lane in ("compute", "h2d", "d2h", "cpu"):
        spans = sorted((o.start_s, o.end_s) for o in ops if o.lane == lane)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))  # one op at a time


@pytest.mark.parametrize("opt,params", POLICIES)
def test_cross_iteration_overlap_and_speedup_over_serial(opt, params):
    slow_cpu = StageTimes(fwd_s=1.0, bwd_s=2.0, h2d_s=0.8, d2h_s=0.8, adam_s=3.0)  # host AdamW is the bottleneck
    ops = schedule(8, slow_cpu, opt, params, iterations=2)
    next_fwd = min(o.start_s for o in ops if o.kind == "fwd" and o.iteration == 1)
    # The next forward starts while some of this iteration's updates are still running.
    assert any(o.kind == "adam" and o.iteration == 0 and o.end_s > next_fwd for o in ops)
    # Layer 0's gradient arrives last, yet its update jumps the queue: FIFO would run it last.
    order = [o.layer for o in sorted(ops, key=lambda o: o.start_s) if o.kind == "adam" and o.iteration == 0]
    assert order[-1] != 0
    serial = schedule(8, slow_cpu, opt, params, iterations=2, overlap=False)
    assert makespan(ops, 1) < makespan(serial, 1)


def test_no_offload_is_plain_compute():
    ops = schedule(4, T, False, False, iterations=2)
    assert {o.lane for o in ops} == {"compute"}
    assert makespan(ops, 1) == pytest.approx(2 * 4 * (T.fwd_s + T.bwd_s))
