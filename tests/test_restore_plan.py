"""The restore planner with plain data: newest common step, cheapest source, TP re-slicing, S3 bytes minimal."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.state.restore_plan import Holding, Need, plan_restore
from workers.transfer import KeeperSource, ProcessSource, S3Piece, S3Source, Tier

pytestmark = pytest.mark.unit
ROWS, COLS = 64, 16  # a unit of 64 x 16 elements, 4 bytes each, 3 tensors (param and two AdamW moments)
UNIT_BYTES = ROWS * COLS * 4 * 3


def region(r0=0, r1=ROWS):
    return ((r0, r1), (0, COLS))


def need(rank, node, unit="h.0.mlp.fc.weight", r0=0, r1=ROWS):
    return Need(rank, node, unit, region(r0, r1), UNIT_BYTES * (r1 - r0) // ROWS)


def live(rank, node, step, unit="h.0.mlp.fc.weight", r0=0, r1=ROWS):
    return Holding(Tier.LIVE, ProcessSource(node, rank, rank), node, unit, region(r0, r1), step, rank)


def peer(node, step, unit="h.0.mlp.fc.weight", r0=0, r1=ROWS):
    return Holding(Tier.PEER, KeeperSource(node, Tier.PEER, 0), node, unit, region(r0, r1), step)


def s3(step, unit="h.0.mlp.fc.weight", r0=0, r1=ROWS):
    piece = S3Piece(f"{unit}-{step}-{r0}", region(r0, r1), 0, "")
    return Holding(Tier.S3, S3Source(piece), None, unit, piece.region, step)


def test_a_surviving_dp_peer_restores_everything_with_no_s3_bytes():
    needs = [need(0, "b"), need(1, "c")]
    plan = plan_restore(needs, [live(5, "b", 9), s3(8)])
    assert plan.step == 9
    assert plan.bytes_by_tier() == {"live": 2 * UNIT_BYTES, "peer": 0, "s3": 0}
    assert [t.source.origin for t in plan.transfers] == [ProcessSource("b", 5, 5)] * 2


def test_the_same_worker_beats_the_same_node_beats_another_node():
    n = need(0, "b")
    holdings = [peer("c", 9), live(7, "b", 9), live(0, "b", 9), s3(9)]
    assert plan_restore([n], holdings).transfers[0].source.origin.index == 0
    assert plan_restore([n], holdings[:2] + holdings[3:]).transfers[0].source.origin.index == 7
    assert plan_restore([n], [peer("c", 9), s3(9)]).transfers[0].source.tier == "peer"


def test_newest_step_at_which_every_unit_is_available():
    a, b = need(0, "b", "wte.weight"), need(0, "b", "lm_head.weight")
    holdings = [live(1, "b", 12, "wte.weight"), s3(10, "wte.weight"), s3(10, "lm_head.weight"),
                s3(8, "wte.weight"), s3(8, "lm_head.weight")]
    plan = plan_restore([a, b], holdings)
    assert plan.step == 10 and plan.bytes_by_tier()["s3"] == 2 * UNIT_BYTES


def test_tp_shards_of_one_plan_feed_another_tp_layout():
    """Old plan: TP 4 (rows in quarters) on two nodes; new plan: TP 2. Each half comes from two quarters."""
    q = ROWS // 4
    holdings = [live(10 + k, "b" if k < 2 else "c", 5, r0=k * q, r1=(k + 1) * q) for k in range(4)]
    needs = [need(0, "b", r0=0, r1=ROWS // 2), need(1, "c", r0=ROWS // 2, r1=ROWS)]
    plan = plan_restore(needs, holdings)
    assert plan.step == 5
    assert {(t.need.rank, t.source.origin.index, t.region[0]) for t in plan.transfers} == {
        (0, 10, (0, q)), (0, 11, (q, 2 * q)), (1, 12, (2 * q, 3 * q)), (1, 13, (3 * q, ROWS))}
    assert plan.bytes_by_tier()["live"] == UNIT_BYTES


def test_only_the_missing_slice_comes_from_s3():
    """A lost node held the top half of a TP-sharded unit and nobody else: S3 sends exactly that half."""
    holdings = [live(3, "b", 7, r0=0, r1=ROWS // 2), s3(7)]
    plan = plan_restore([need(0, "b")], holdings)
    assert plan.bytes_by_tier() == {"live": UNIT_BYTES // 2, "peer": 0, "s3": UNIT_BYTES // 2}
    s3_only = plan_restore([need(0, "b")], holdings, only_tiers={"s3"})
    assert s3_only.step == 7 and s3_only.bytes_by_tier() == {"live": 0, "peer": 0, "s3": UNIT_BYTES}


def test_nothing_holds_a_unit():
    plan = plan_restore([need(0, "b", "wpe.weight")], [s3(3)])
    assert plan.step is None and plan.missing == ["wpe.weight"]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(1, ROWS - 1), max_size=5, unique=True),
       lost=st.sets(st.integers(0, 5)), new_tp=st.sampled_from([1, 2, 4]))
def test_s3_bytes_are_exactly_what_no_memory_source_holds(cuts, lost, new_tp):
    """Random old shards, some lost; every need is covered exactly once, S3 sends only the lost rows."""
    bounds = [0, *sorted(cuts), ROWS]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    holdings = [live(20 + i, "b", 4, r0=a, r1=b) for i, (a, b) in enumerate(pieces) if i not in lost] + [s3(4)]
    rows = ROWS // new_tp
    needs = [need(k, "b", r0=k * rows, r1=(k + 1) * rows) for k in range(new_tp)]
    plan = plan_restore(needs, holdings)
    lost_rows = sum(b - a for i, (a, b) in enumerate(pieces) if i in lost)
    assert plan.step == 4
    per_row = UNIT_BYTES // ROWS
    assert plan.bytes_by_tier()["s3"] == lost_rows * per_row
    assert sum(plan.bytes_by_tier().values()) == UNIT_BYTES
    for n in needs:  # each need's rows covered once, in order
        got = sorted(t.region[0] for t in plan.transfers if t.need == n)
        assert got[0][0] == n.region[0][0] and got[-1][1] == n.region[0][1]
        assert all(x[1] == y[0] for x, y in zip(got, got[1:], strict=False))


def test_on_one_node_a_survivors_live_state_is_taken_before_a_peer_copy():
    """Same node, same cost class: the tie goes to the live tier (what the survivors kept), in any order."""
    for holdings in ([peer("b", 9), live(5, "b", 9)], [live(5, "b", 9), peer("b", 9)]):
        plan = plan_restore([need(0, "b")], holdings)
        assert plan.bytes_by_tier() == {"live": UNIT_BYTES, "peer": 0, "s3": 0}


@pytest.mark.parametrize("new_tp", [1, 2, 4])
def test_a_unit_sharded_on_its_second_dimension_is_cut_along_that_dimension(new_tp):
    """Row-parallel units (attn.proj, mlp.proj) are sharded on dim 1. A need that one holding matches exactly
    (the same TP layout after the loss) must still be cut along dim 1: every transfer lies inside both its
    need and its source, and the transfers tile each need. (The planner once swept dim 1 and wrote the stretch
    into dim 0, which loads clipped to the right weights but not to the right bytes.)"""
    unit, shape = "h.0.mlp.proj.weight", (32, 64)

    def cols(c0, c1):
        return ((0, shape[0]), (c0, c1))

    held = [Holding(Tier.LIVE, ProcessSource("a", k, k), "a", unit, cols(32 * k, 32 * (k + 1)), 5, k) for k in range(2)]
    w = shape[1] // new_tp
    needs = [Need(k, "a", unit, cols(w * k, w * (k + 1)), shape[0] * w * 12) for k in range(new_tp)]
    plan = plan_restore(needs, held)
    assert plan.step == 5
    for n in needs:
        mine = [t for t in plan.transfers if t.need is n]
        for t in mine:
            for (a, b), (na, nb), (sa, sb) in zip(t.region, n.region, t.source.region, strict=True):
                assert na <= a < b <= nb and sa <= a and b <= sb, (t.region, n.region, t.source.region)
        assert sum((t.region[1][1] - t.region[1][0]) for t in mine) == n.region[1][1] - n.region[1][0]
        assert all(t.region[0] == (0, shape[0]) for t in mine)


def _sweep_every_piece(needs: list[Need], holdings: list[Holding]):
    """The planner as it was written first, for reference: every need's cover swept over every holding of its unit
    at the step (quadratic in the replicas; the planner now looks at a few pieces per region and tier)."""
    from orchestrator.state.restore_plan import RestorePlan, _cover, _transfers

    by_unit: dict = {}
    for h in holdings:
        by_unit.setdefault(h.unit, []).append(h)
    for step in sorted({h.step for h in holdings}, reverse=True):
        out = []
        for n in needs:
            pieces = [h for h in by_unit.get(n.unit, ()) if h.step == step]
            d = next((d for p in pieces for d, (a, b) in enumerate(p.region) if (a, b) != n.region[d]), 0)
            cover = _cover(n, pieces, d)
            if cover is None:
                break
            out += _transfers(n, cover, d)
        else:
            return RestorePlan(step, out)
    return RestorePlan(None, [], sorted({n.unit for n in needs} - set(by_unit)))


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_the_planner_picks_what_a_sweep_over_every_holding_picks(data):
    """Many replicas of a unit on a few nodes, in every tier, TP-sliced two ways, at two steps, some kept processes
    with the new plan's ranks: the grouped planner's transfers are the full sweep's, source for source."""
    nodes = ["a", "b", "c", "d", "e", "f"][:data.draw(st.integers(1, 6))]
    units = ["u0", "u1"]
    holdings = []
    for _ in range(data.draw(st.integers(0, 60))):
        kind = data.draw(st.sampled_from(["live", "peer", "s3"]))
        unit, step = data.draw(st.sampled_from(units)), data.draw(st.integers(1, 2))
        tp = data.draw(st.sampled_from([1, 1, 2, 4]))
        k = data.draw(st.integers(0, tp - 1))
        r0, r1 = k * ROWS // tp, (k + 1) * ROWS // tp
        if kind == "live":
            holdings.append(live(data.draw(st.integers(0, 11)), data.draw(st.sampled_from(nodes)), step, unit, r0, r1))
        elif kind == "peer":
            holdings.append(peer(data.draw(st.sampled_from(nodes)), step, unit, r0, r1))
        else:
            holdings.append(s3(step, unit, r0, r1))
    tp = data.draw(st.sampled_from([1, 2]))
    needs = [need(r, data.draw(st.sampled_from(nodes)), u, (r % tp) * ROWS // tp, (r % tp + 1) * ROWS // tp)
             for r in range(data.draw(st.integers(1, 12))) for u in units]
    got, want = plan_restore(needs, holdings), _sweep_every_piece(needs, holdings)
    assert got.step == want.step and got.missing == want.missing
    assert [(t.need, t.source, t.region, t.nbytes) for t in got.transfers] == \
        [(t.need, t.source, t.region, t.nbytes) for t in want.transfers]


def test_among_replicas_the_first_of_the_cheapest_class_is_taken():
    """Replicas of one region: other nodes' first, then the need's node's, then the need's own rank's; the pick
    is the cheapest class (own rank, else own node, else another node), live before a peer copy within a class,
    and the first of those in the holdings' order."""
    holdings = [peer("x", 1), live(5, "y", 1), live(6, "y", 1), peer("a", 1), live(3, "a", 1), live(4, "a", 1),
                live(2, "z", 1), live(2, "b", 1)]
    assert plan_restore([need(9, "a")], holdings).transfers[0].source == holdings[4]  # own node, live, first
    assert plan_restore([need(2, "a")], holdings).transfers[0].source == holdings[6]  # own rank, wherever it is
    assert plan_restore([need(9, "q")], holdings).transfers[0].source == holdings[1]  # another node: live, first
