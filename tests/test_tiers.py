"""The tiered state plane (orchestrator/state/tiers.py) over the shipped fakes, without a Ray cluster: keepers
as plain objects reached through `LocalCalls`, workers as `LocalGroup` over numpy shards, S3 on moto's server.
Snapshots and the uploader write whole steps; after three of four nodes die, a restore takes each unit from the cheapest
source left (survivors' live state, a peer snapshot on a survivor, else S3) and brings back exactly the
committed step; a corrupt S3 piece makes it refuse that step and go back to the previous one. In place, survivors
keep their state in their own processes (`LocalPool`): a DP survivor restores with no byte moved, and a loss that
changes the TP layout re-shards from survivors' memory, with peer copies only for the lost layers."""


import numpy as np
import pytest

from orchestrator.state.calls import LocalCalls
from orchestrator.state.fakes import LocalGroup, LocalPool, model_units, unit_name, values
from orchestrator.state.recovery import InPlace
from orchestrator.state.s3_store import S3Checkpoints
from orchestrator.state.tiers import TieredState
from planner import Pipeline, Plan, Stage
from tests.moto_s3 import moto_s3, use_test_credentials

pytestmark = pytest.mark.unit
LAYERS = 4


def plan(*stages: tuple[int, int, str], tp: int = 1) -> Plan:
    return Plan(model_name="m", num_layers=LAYERS, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=1, num_micro_batches=8, stages=[
            Stage(layer_start=a, layer_end=b, gpu_type="L4", node=n, devices=[f"{n}/{k}" for k in range(tp)])
            for a, b, n in stages])])


OLD = plan((0, 1, "a"), (1, 2, "b"), (2, 3, "c"), (3, 4, "d"))
NEW = plan((0, 4, "a"))  # the survivor takes every layer


@pytest.fixture(scope="module")
def endpoint():
    use_test_credentials()
    with moto_s3("tiers") as url:
        yield url


def trained(endpoint: str, prefix: str, steps: int = 4):
    """Four nodes, one stage each; every step snapshotted to a peer keeper and uploaded whole to S3."""
    calls = LocalCalls(["a", "b", "c", "d"])
    s3 = S3Checkpoints(f"s3://tiers/{prefix}", endpoint)
    store = TieredState(1, s3, s3_every=1, keep=3, meta={"job": prefix}, model_units=model_units(LAYERS), calls=calls)
    group = LocalGroup(OLD, calls)
    for step in range(steps):
        group.commit(step)
        assert store.after_step(group, step)
        store.flush()  # each upload done before the next step (the one-slot coalescing is tested on Ray)
    return calls, s3, store, group


def expected_sources(calls: LocalCalls, step: int) -> dict[str, str]:
    """Per unit of the new plan, the cheapest tier a survivor's keeper holds it in at `step`, else S3."""
    best: dict[str, str] = {}
    for node, k in calls.keepers.items():
        if node in calls.dead:
            continue
        for row in k.inventory():
            if row.step == step and (row.tier == "live" or best.get(row.unit) != "live"):
                best[row.unit] = row.tier
    return {unit_name(x): best.get(unit_name(x), "s3") for x in range(-1, LAYERS + 1)}


def assert_holds(group: LocalGroup, step: int) -> None:
    """Every rank holds its own region of every unit of its stage, at `step`."""
    for units, shards, reg in zip(group.units, group.shards, group.regions, strict=True):
        assert sorted(shards) == sorted(units)
        for unit, s in shards.items():
            for k, v in values(step, unit).items():
                assert np.array_equal(s[k], v[tuple(slice(a, b) for a, b in reg)]), (unit, k, step)


def test_snapshots_and_uploads_write_whole_steps_and_keep_the_newest(endpoint):
    _, s3, store, _ = trained(endpoint, "whole")
    assert sorted(s3.complete_steps()) == [1, 2, 3]
    assert [u.status for u in store.uploads] == ["written"] * 4
    assert store.upload_lag(3) == {"newest_step": 3, "lag_steps": 0, "backlog": 0, "dropped": 0, "failed": 0,
                                   "no_access": []}


def test_a_restore_mixes_live_peer_and_s3_sources_and_brings_back_the_committed_step(endpoint):
    calls, _, store, group = trained(endpoint, "mix")
    for n in "bcd":  # peer copies went a <-> b and c <-> d: a keeps its own state and b's copy
        calls.kill(n)
    store.salvage(group)  # a hands its committed state to its own keeper
    want = expected_sources(calls, 3)
    assert set(want.values()) == {"live", "peer", "s3"}, want  # the case this test is for
    new = LocalGroup(NEW, calls)
    r = store.restore(new)
    assert r.step == 3 and r.refused_steps == []
    assert r.s3_units == sorted(u for u, t in want.items() if t == "s3")
    assert {t for t, n in r.bytes_by_tier.items() if n} == {"live", "peer", "s3"}
    assert_holds(new, 3)


def test_a_corrupt_s3_piece_is_refused_and_the_previous_step_restores(endpoint, caplog):
    calls, s3, store, group = trained(endpoint, "corrupt")
    for n in "bcd":
        calls.kill(n)
    store.salvage(group)
    want = expected_sources(calls, 3)
    lost = sorted(u for u, t in want.items() if t == "s3")
    manifest = s3.whole_manifest(3)
    key = manifest["units"][lost[0]]["pieces"][0]["key"]
    s3.client.put_object(Bucket="tiers", Key=key, Body=b"bytes that are not the piece")
    new = LocalGroup(NEW, calls)
    r = store.restore(new)
    assert r.refused_steps == [3] and r.step == 2 and 3 in store.bad_steps
    assert any("refusing checkpoint step 3" in m for m in caplog.messages)
    assert_holds(new, 2)


def test_an_upload_a_restore_went_back_from_is_not_written_and_the_redo_is(endpoint):
    """Step 2 uploads (its keepers slow) when a restore goes back to step 1; the redo's steps 2, 3 and 4 queue
    behind it (2 and 3 dropped for newer ones). Step 2's first try is not written: its state is redone and its peer
    copies are replaced by the redo's, so what it read may be of two tries (in CI the dropped redo of step 2 let
    the keepers prune the first try's copies mid-upload: a KeyError). Dropping the redo of the step in flight keeps
    that step's copies; the redo's newest step is written whole, and no pin is left behind."""
    import time

    calls = LocalCalls(["a", "b", "c", "d"])
    s3 = S3Checkpoints("s3://tiers/rollback", endpoint)
    store = TieredState(1, s3, s3_every=1, keep=5, meta={"job": "rollback"}, model_units=model_units(LAYERS),
                        calls=calls, restore_from="s3")
    group = LocalGroup(OLD, calls)
    for step in range(2):
        group.commit(step)
        store.after_step(group, step)
        store.flush()
    for k in calls.keepers.values():
        k.hold_uploads()  # step 2's first try stays in flight until the redo below is queued, however slow the machine
    group.commit(2)
    store.after_step(group, 2)
    until = time.monotonic() + 10
    while store._inflight != 2:
        assert time.monotonic() < until, "step 2's upload never started"
        time.sleep(0.01)
    new = LocalGroup(NEW, calls)
    assert store.restore(new).step == 1  # from S3 only: step 2 is not there yet
    for step in (2, 3, 4):  # the redo: each step's upload waits behind the one in flight
        new.commit(step)
        store.after_step(new, step)
    for k in calls.keepers.values():
        k.release_uploads()  # the first try of step 2 reads its copies now, after the redo replaced them
    store.flush()
    assert [(u.step, u.status) for u in store.uploads[2:]] == [
        (2, "dropped"), (3, "dropped"), (2, "failed"), (4, "written")], store.uploads  # the redo's 2 and 3, then
    first = store.uploads[4]  # the first try of step 2 ends
    assert "rolled back to step 1" in first.error and "not written" in first.error, first.error
    assert sorted(s3.complete_steps()) == [0, 1, 4]
    s3.whole_manifest(4)
    assert all(not k.pinned for k in calls.keepers.values())


def test_a_keeper_whose_node_goes_under_its_upload_fails_the_step_naming_the_node(endpoint):
    """The cover of step 2 is chosen from keepers that answered; then, while the first keeper's upload runs, the
    other nodes go. The upload fails as a checkpoint error that names a node that went and says the step is not
    written (not Ray's or the fake's own exception text); no manifest of step 2 is written and no pin is left."""
    import threading

    calls = LocalCalls(["a", "b", "c", "d"])
    s3 = S3Checkpoints("s3://tiers/went-under-upload", endpoint)
    store = TieredState(1, s3, s3_every=1, keep=5, meta={"job": "went"}, model_units=model_units(LAYERS),
                        calls=calls)
    group = LocalGroup(OLD, calls)
    for step in range(2):
        group.commit(step)
        store.after_step(group, step)
        store.flush()
    entered = threading.Event()
    for k in calls.keepers.values():
        k.hold_uploads()
        k.upload = (lambda orig: lambda *a, **kw: (entered.set(), orig(*a, **kw))[1])(k.upload)
    group.commit(2)
    store.after_step(group, 2)
    assert entered.wait(10), "step 2's upload never reached a keeper"
    gone = {"b", "c", "d"}  # (one of them may be the keeper whose upload runs: it ends; a later one fails)
    for n in gone:
        calls.kill(n)
    for k in calls.keepers.values():
        k.release_uploads()
    store.flush()
    got = store.uploads[-1]
    assert (got.step, got.status) == (2, "failed"), store.uploads
    assert "not written" in got.error and any(f"the keeper on {n} went" in got.error for n in gone), got.error
    assert sorted(s3.complete_steps()) == [0, 1]


def test_s3_every_counts_steps_on_the_snapshot_steps(endpoint):
    """Snapshots every 2 steps and S3 every 4: peer copies at steps 1, 3, 5, 7, uploads at steps 3 and 7."""
    calls = LocalCalls(["a", "b", "c", "d"])
    s3 = S3Checkpoints("s3://tiers/every", endpoint)
    store = TieredState(2, s3, s3_every=4, keep=5, meta={"job": "every"}, model_units=model_units(LAYERS), calls=calls)
    group = LocalGroup(OLD, calls)
    taken = []
    for step in range(8):
        group.commit(step)
        taken.append(store.after_step(group, step))
        store.flush()
    assert [s for s, t in enumerate(taken) if t] == [1, 3, 5, 7]
    assert sorted(s3.complete_steps()) == [3, 7]
    with pytest.raises(ValueError, match="multiple of peer_every"):
        TieredState(2, s3, s3_every=5, model_units=model_units(LAYERS), calls=calls)
    assert TieredState(1000, calls=calls).s3 is None  # without an S3 tier, s3_every means nothing


def test_a_staged_drain_starts_its_keepers_off_the_doomed_node_ahead_and_none_on_it():
    """A notice's pre-staged switch starts the keepers its drain will copy to before the switch (none on the
    doomed node, none when other replicas hold its layers); the drain then copies to those keepers only."""
    calls = LocalCalls(["a", "b", "c", "d"])
    store = TieredState(100, None, model_units=model_units(LAYERS), calls=calls)
    group = LocalGroup(OLD, calls)
    group.commit(0)
    store.prepare_drain(group, {"d"})
    ahead = set(calls.keepers)
    assert ahead and "d" not in ahead and store.drain_ready()
    store.drain(group, 0, {"d"})
    assert "d" not in calls.keepers  # no keeper was started on the doomed node, for a salvage or otherwise
    assert any(row.tier == "peer" for n in ahead for row in calls.keepers[n].inventory())
    replicated = TieredState(100, None, model_units=model_units(LAYERS), calls=LocalCalls(["a", "b"]))
    both = LocalGroup(Plan(model_name="m", num_layers=LAYERS, global_batch=8, pipelines=[Pipeline(
        num_samples=4, micro_batch_size=1, num_micro_batches=4, stages=[
            Stage(layer_start=0, layer_end=LAYERS, gpu_type="L4", node=n, devices=[f"{n}/0"])]) for n in "ab"]),
        replicated.calls)
    replicated.prepare_drain(both, {"b"})
    assert replicated.calls.keepers == {}  # a's replica holds every layer b holds: nothing to copy, nothing started


def test_a_doomed_node_that_goes_before_its_drain_copy_lands_is_a_loss_the_controller_re_plans(endpoint):
    """The drain waits for the doomed node's copy. When the node goes first (its deadline came before the copy
    landed), the drain raises the one failure type a re-plan reads (transient, naming the node), not Ray's
    or the fake's own error; the newest whole step restores after it, so the loss costs steps, not the job."""
    from orchestrator.control.failure import is_transient
    from orchestrator.errors import WorkerFailure

    calls, s3, store, group = trained(endpoint, "drain-lost")
    group.commit(4)
    calls.kill("d")
    with pytest.raises(WorkerFailure) as got:
        store.drain(group, 4, {"d"})
    assert is_transient(got.value.kind) and got.value.kind == "node lost" and got.value.nodes == ["d"]
    assert "drain snapshot of step 4" in str(got.value)
    new = LocalGroup(plan((0, 2, "a"), (2, 4, "b")), calls)
    report = store.restore(new, {"d"})
    assert report is not None and report.step == 3 and new.step == 3  # the newest whole step: S3's


# -- in place (runtime.recovery: in-place), without Ray: survivors keep their state in their own processes --------
def test_in_place_a_dp_survivor_restores_from_its_own_memory_and_moves_no_byte():
    """Two replicas on a and b; b dies. a's process keeps step 3 (salvage), takes the new plan's rank, and reads
    every unit in place: no keeper, no S3, nothing moved."""
    calls, pool = LocalCalls(["a", "b"]), LocalPool()
    store = TieredState(100, None, model_units=model_units(LAYERS), calls=calls)  # no snapshot before the loss
    old = LocalGroup(Plan(model_name="m", num_layers=LAYERS, global_batch=8, pipelines=[
        plan((0, LAYERS, n)).pipelines[0].model_copy(update={"num_samples": 4, "num_micro_batches": 4})
        for n in "ab"]), calls, InPlace(pool))
    for step in range(4):
        old.commit(step)
        store.after_step(old, step)
    calls.kill("b")
    store.salvage(old)
    assert [k is not None for k in old.retained] == [True, False]  # the dead node's process is not kept
    old.release()
    new = LocalGroup(plan((0, LAYERS, "a")), calls, InPlace(pool))
    assert new.pids == [old.pids[0]]  # the survivor's process is the new rank
    r = store.restore(new)
    assert r.step == 3 and r.bytes == 0 and r.tier == "in place"
    assert r.in_place_bytes == sum(n.nbytes for n in new.needs()[0]) and not calls.keepers
    assert_holds(new, 3)
    store.after_step(new, 4)  # a step committed: the kept copies go
    assert all(p.retained is None for p in new.procs) and not pool.idle


def test_in_place_a_reshard_reads_survivors_memory_across_tp_layouts_and_peers_only_for_the_lost_layers():
    """Old: two stages of TP 2, layers [0, 2) on a and [2, 4) on b, peer copies every step (b's on a's keeper).
    b dies; the new plan is one stage of TP 4 on a. Each new rank reads its quarter of a's units from its own
    process where it held it (in place), from the other kept process on a (live), and b's units from the peer
    copy on a's keeper: exactly the committed step, nothing from S3."""
    calls, pool = LocalCalls(["a", "b"]), LocalPool()
    store = TieredState(1, None, model_units=model_units(LAYERS), calls=calls)
    old = LocalGroup(plan((0, 2, "a"), (2, LAYERS, "b"), tp=2), calls, InPlace(pool))
    for step in range(3):
        old.commit(step)
        store.after_step(old, step)
    calls.kill("b")
    store.salvage(old)
    assert [k is not None for k in old.retained] == [True, True, False, False]
    old.release()
    new = LocalGroup(plan((0, LAYERS, "a"), tp=4), calls, InPlace(pool))
    assert sum(new.kept) == 2 and set(new.pids) >= set(old.pids[:2])  # a's two processes are two of the new ranks
    r = store.restore(new)
    assert r.step == 2 and r.bytes_by_tier["s3"] == 0
    assert r.in_place_bytes > 0 and r.bytes_by_tier["live"] > 0 and r.bytes_by_tier["peer"] > 0, r
    assert r.bytes + r.in_place_bytes == sum(n.nbytes for rank in new.needs() for n in rank)
    assert_holds(new, 2)


def test_in_place_a_process_that_cannot_prove_its_step_is_not_kept_and_a_rank_after_it_restores_anyway():
    """A rank asked to keep a step it does not hold is replaced (None); what it held does not serve the restore."""
    calls, pool = LocalCalls(["a"]), LocalPool()
    store = TieredState(1, None, model_units=model_units(LAYERS), calls=calls)
    old = LocalGroup(plan((0, LAYERS, "a")), calls, InPlace(pool))
    old.commit(0)
    store.after_step(old, 0)
    assert old.retain(5) == [None]  # step 5 was never committed here
    old.retain(None)
    old.release()
    new = LocalGroup(plan((0, LAYERS, "a")), calls, InPlace(pool))
    r = store.restore(new)
    assert r.step == 0 and r.in_place_bytes > 0
    assert_holds(new, 0)


def test_s3_refusing_the_writer_lock_is_said_and_the_job_goes_on_while_another_writer_stops_it(endpoint, caplog):
    """The run's writer lock: a lock S3 cannot give now (a 503, a timeout) is a warning and the job goes on without
    it (each manifest write is still checked); a lock another job holds is a WriterConflict, raised to the
    controller (exit 2)."""
    from orchestrator.errors import WriterConflict

    def refusing(run_id, job=None):
        raise RuntimeError("503 SlowDown")

    s3 = S3Checkpoints("s3://tiers/lock", endpoint)
    store = TieredState(1, s3, meta={"job": "lock", "run_id": "r1"}, model_units=model_units(LAYERS),
                        calls=LocalCalls(["a"]))
    s3.claim_writer = refusing
    store.claim()
    assert store.writer is None and store.writer_lost() is None
    assert any("could not take the run's writer lock (RuntimeError: 503 SlowDown); going on without it" in m
               for m in caplog.messages)

    def taken(run_id, job=None):
        raise WriterConflict("run r1 is being written by another job")

    s3.claim_writer = taken
    with pytest.raises(WriterConflict, match="another job"):
        store.claim()


def test_a_salvage_that_fails_is_said_and_costs_the_job_nothing(caplog):
    """Survivors' state the salvage could not keep is a warning: the other tiers still hold the step, and the
    state plane's caller (the controller's recovery) goes on."""
    calls = LocalCalls(["a", "b"])
    store = TieredState(1, None, model_units=model_units(LAYERS), calls=calls)
    group = LocalGroup(plan((0, 2, "a"), (2, LAYERS, "b")), calls)
    group.commit(0)
    store.after_step(group, 0)

    def broken(*a, **k):
        raise ConnectionError("keeper on a went away")

    store.restorer.salvage = broken
    store.salvage(group, {"b"}, 0)
    assert any("salvaging survivors' state failed: keeper on a went away" in m for m in caplog.messages)
