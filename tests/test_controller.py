"""Controller unit tests: every transition driven by step() with a fake node source and worker group."""

import pytest

from orchestrator.control.controller import Controller, State
from orchestrator.control.fakes import FakeNodes
from orchestrator.control.fakes import FakeWorkerGroup as FakeGroup
from orchestrator.control.policy import Policy
from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec

pytestmark = pytest.mark.unit
MODEL, TRAIN = ModelSpec.preset("tiny"), TrainSpec(global_batch=8)


BIG = ClusterSpec(nodes=[NodeSpec(name="a", gpu_type="A100-80GB", num_gpus=2),
                         NodeSpec(name="l", gpu_type="L4", num_gpus=2)])
SMALL = ClusterSpec(nodes=[NodeSpec(name="l", gpu_type="L4", num_gpus=2)])  # the A100 node was lost


def make(nodes, failures=None, fail_start=False, group_kw=None, train=TRAIN, **kw):
    log, groups = [], []

    def factory(plan):
        g = FakeGroup(plan, log, failures.pop(0) if failures else None, fail_start and not groups, **(group_kw or {}))
        groups.append(g)
        return g

    policy = Policy(**{k: kw.pop(k) for k in list(kw) if k in Policy.__dataclass_fields__})  # the knobs, whole
    return Controller(MODEL, train, kw.pop("steps", 4), nodes, factory, policy=policy, **kw), log, groups


def test_happy_path_transitions():
    c, log, _ = make(FakeNodes(BIG))
    assert c.step() == State.PLANNING
    assert c.step() == State.LAUNCHING and c.plan is not None
    assert c.step() == State.TRAINING
    for _ in range(4):
        assert c.step() == State.TRAINING
    assert c.step() == State.DONE
    assert c.progress.losses == {0: 10.0, 1: 9.0, 2: 8.0, 3: 7.0}
    assert log[-1] == ("shutdown",)


def test_worker_failure_replans_on_survivors_and_resumes_at_committed_step():
    c, log, groups = make(FakeNodes(BIG, SMALL), failures=[[2]], snapshot_every=1)
    assert c.run() == State.DONE
    assert c.progress.restarts == 1
    assert "training->recovering" in c.progress.history and "recovering->discovering" in c.progress.history
    assert len(groups) == 2 and groups[1].plan.devices() != groups[0].plan.devices()
    assert all(d.startswith("l/") for d in groups[1].plan.devices())  # re-planned on the survivors
    assert ("import", 2) in log  # restored the snapshot after committed step 1
    assert c.progress.losses == {0: 10.0, 1: 9.0, 2: 8.0, 3: 7.0}  # same losses as an uninterrupted run


def test_rollback_to_snapshot_when_not_every_step_snapshotted():
    c, log, _ = make(FakeNodes(BIG, SMALL), failures=[[3]], snapshot_every=2, steps=5)
    assert c.run() == State.DONE
    assert ("import", 2) in log  # step 2 was committed but not snapshotted: redone after restore
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}
    assert sorted(c.progress.step_time_s) == list(range(5))  # rolled-back steps leave no stray timing


def test_too_many_failures_abort_with_cause():
    c, _, _ = make(FakeNodes(BIG), failures=[[1], [1], [1]], max_restarts=2)
    assert c.run() == State.FAILED
    assert "node lost" in c.error and "gave up after 2" in c.error


def test_a_failure_that_takes_no_node_and_comes_back_on_every_plan_stops_the_job_at_the_fifth():
    """A transient kind that every new plan meets again at the same step (here a timeout of step 1, no node
    gone) stops the job at runtime.max_failures_without_progress, not after max_restarts re-plans."""
    c, log, groups = make(FakeNodes(BIG), failures=[[1] for _ in range(8)], group_kw={"fail_kind": "timeout"})
    assert c.run() == State.FAILED
    assert len(groups) == 5 and c.progress.restarts == 4  # four re-plans, the fifth failure stops it
    assert "timeout" in c.error and "5 failures in a row with no node lost and no step committed" in c.error
    assert "max_failures_without_progress" in c.error
    assert c.progress.losses == {0: 10.0}  # step 0 stays committed; nothing past it was trained


def test_failures_that_take_nodes_or_come_after_progress_never_add_up_to_the_stop():
    # Eight node losses in a row at the same step: each a spot loss the next plan leaves out; none counts.
    c, _, groups = make(FakeNodes(BIG), failures=[[1] for _ in range(8)], steps=3)
    assert c.run() == State.DONE and c.progress.restarts == 8
    # Six timeouts, each one step later than the last (the job goes on between them): none follows another
    # with no step committed, so the job finishes with its uninterrupted losses.
    c, _, groups = make(FakeNodes(BIG), failures=[[s] for s in range(1, 7)], steps=8, group_kw={"fail_kind": "timeout"})
    assert c.run() == State.DONE and c.progress.restarts == 6
    assert c.progress.losses == {s: 10.0 - s for s in range(8)}
    # Two stalled timeouts, a node loss, then four more stalled timeouts: the loss starts the count over.
    c, _, _ = make(FakeNodes(BIG), failures=[[1] for _ in range(7)], steps=3, max_stalled=5,
                   group_kw={"fail_kind": "timeout"})
    kinds = iter(["timeout", "timeout", "node lost", "timeout", "timeout", "timeout", "timeout"])
    c.make_group = _with_kinds(c.make_group, kinds)
    assert c.run() == State.DONE and c.progress.restarts == 7


def _with_kinds(factory, kinds):
    def make_group(plan):
        g = factory(plan)
        g.fail_kind = next(kinds, "timeout")
        return g
    return make_group


def test_failure_during_launch_is_a_decision():
    c, _, _ = make(FakeNodes(BIG, SMALL), fail_start=True)
    c.step(), c.step()
    assert c.step() == State.RECOVERING
    assert c.run() == State.DONE


def test_no_plan_on_survivors_fails_cleanly():
    tiny_gpu = ClusterSpec(nodes=[NodeSpec(name="t", gpu_type="T4", num_gpus=1)])
    huge = ModelSpec(name="huge", num_layers=2, hidden_size=8192, num_heads=64, vocab_size=32000, seq_len=65536)
    c = Controller(huge, TRAIN, 2, FakeNodes(tiny_gpu), lambda p: None)
    c.step()
    assert c.step() == State.FAILED and "does not fit" in c.error


def test_deterministic_worker_error_aborts_without_replanning():
    log, groups = [], []

    def factory(plan):
        g = FakeGroup(plan, log, [1], fail_kind="error")
        groups.append(g)
        return g

    c = Controller(MODEL, TRAIN, 4, FakeNodes(BIG, SMALL), factory)
    assert c.run() == State.FAILED
    assert c.progress.restarts == 0 and len(groups) == 1  # no second plan was tried
    assert "any plan would hit again" in c.error


def _user_plan_controller(replan: bool):
    from planner import plan

    first = plan(BIG, MODEL, TRAIN)
    c, log, groups = make(FakeNodes(SMALL), failures=[[2]], first_plan=first, user_plan=True,
                          replan_user_plan=replan)
    return c, first, groups


def test_user_plan_is_not_replaced_without_being_asked():
    c, first, groups = _user_plan_controller(replan=False)
    assert c.state == State.LAUNCHING and c.plan is first  # no discovery, no planning
    assert c.run() == State.FAILED
    assert "--replan-on-loss" in c.error and len(groups) == 1


def test_user_plan_replaced_on_loss_when_asked():
    c, first, groups = _user_plan_controller(replan=True)
    assert c.run() == State.DONE
    assert c.progress.restarts == 1 and groups[1].plan is not first
    assert c.progress.losses == {s: 10.0 - s for s in range(4)}


def test_notice_drains_at_a_step_boundary_without_losing_a_step():
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    notice = Notice(node="a", deadline_s=120.0, source="aws")
    c, log, groups = make(FakeNodes(BIG), snapshot_every=100, steps=5,
                          interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    assert "training->draining" in c.progress.history and c.progress.drains == 1 and c.progress.restarts == 0
    assert ("import", 2) in log  # snapshot of committed step 1 taken at the boundary: nothing redone
    assert all(not d.startswith("a/") for d in groups[1].plan.devices())  # the doomed node is left out
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}
    drain = c.progress.events[0]
    assert drain["kind"] == "drain" and "aws" in drain["cause"] and drain["met_deadline"] is True
    assert drain["notice_s"] <= drain["snapshot_s"] <= drain["plan_s"] <= drain["first_step_s"] < drain["deadline_s"]
    assert all(t == 0.5 for t in c.progress.step_time_s.values())  # the injected clock times the steps


def test_an_in_place_notice_pre_stages_the_next_plan_and_switches_once_its_workers_are_ready():
    """In place, the notice's next plan is chosen at once and its new workers warm while the doomed node
    trains on; the switch comes at the first step boundary where they are ready, and that plan is launched."""
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    notice = Notice(node="a", deadline_s=120.0, source="aws")
    c, log, groups = make(FakeNodes(BIG), snapshot_every=100, steps=7, group_kw={"stages_switch": True,
                                                                                   "ready_after": 2},
                          interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    assert ("prestage", 2) in log and c.progress.drains == 1 and c.progress.restarts == 0
    assert log.index(("prestage", 2)) < log.index(("import", 4))  # staged at step 2, switched after step 3
    assert len(groups) == 2 and all(not d.startswith("a/") for d in groups[1].plan.devices())
    assert "planning" not in "".join(c.progress.history[c.progress.history.index("training->draining"):])
    assert c.progress.losses == {s: 10.0 - s for s in range(7)}  # nothing lost or redone
    drain = c.progress.events[0]
    assert drain["new_workers"] == 2 and drain["met_deadline"] is True
    order = ["notice_s", "staged_s", "ready_s", "switch_s", "snapshot_s", "plan_s", "resumed_s", "first_step_s"]
    assert [drain[k] for k in order] == sorted(drain[k] for k in order)
    assert drain["stall_s"] == round(drain["resumed_s"] - drain["switch_s"], 3)


def test_a_notice_repeated_at_every_poll_while_its_switch_is_staged_is_one_drain():
    """A Ray drain is reported at every poll while the node drains; the staged switch heeds it once."""
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    notice = Notice(node="a", deadline_s=120.0, source="ray-drain")
    c, log, groups = make(FakeNodes(BIG), snapshot_every=100, steps=8, group_kw={"stages_switch": True,
                                                                                   "ready_after": 3},
                          interruptions=FakeInterruptions({k: [notice] for k in range(2, 8)}),
                          clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    drains = [e for e in c.progress.events if e["kind"] == "drain"]
    assert len(drains) == 1 and drains[0]["met_deadline"] is True and log.count(("prestage", 2)) == 1
    assert c.progress.losses == {s: 10.0 - s for s in range(8)}


def test_a_pre_staged_switch_does_not_wait_past_its_deadline_for_workers_that_are_not_ready():
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    clock = FakeClock(tick=0.5)
    notice = Notice(node="a", deadline_s=12.0, source="gcp")
    c, log, groups = make(FakeNodes(BIG), snapshot_every=100, steps=12, group_kw={"stages_switch": True,
                                                                                   "ready_after": 99},
                          interruptions=FakeInterruptions({2: [notice]}), clock=clock)
    assert c.run() == State.DONE
    drain = c.progress.events[0]
    assert "ready_s" not in drain and drain["met_deadline"] is True and drain["snapshot_s"] <= drain["deadline_s"]
    assert drain["switch_s"] > drain["staged_s"] + 1.0  # it trained on while it could
    assert c.progress.losses == {s: 10.0 - s for s in range(12)}


def test_a_node_that_goes_during_its_drain_is_recovered_like_any_loss():
    """The doomed node goes while the drain copies its state (the copy outlasted the deadline): the drain's
    failure re-plans on what is left, the steps no tier holds are redone, and the drain's event says it did not
    meet its deadline."""
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice
    from orchestrator.errors import WorkerFailure

    class DiesDuringDrain(FakeGroup):
        def export_state(self):
            if self.log.count(("drain-export",)) == 0 and any(e["kind"] == "drain" for e in c.progress.events):
                self.log.append(("drain-export",))
                raise WorkerFailure("drain snapshot of step 1", "a rank or its keeper went", "node lost", ["a"])
            return super().export_state()

    log, groups = [], []
    notice = Notice(node="a", deadline_s=120.0, source="aws")

    def factory(plan):
        groups.append(DiesDuringDrain(plan, log) if not groups else FakeGroup(plan, log))
        return groups[-1]

    c = Controller(MODEL, TRAIN, 5, FakeNodes(BIG, SMALL), factory,
                   policy=Policy(snapshot_every=100),  # the drain's is the copy
                   interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    assert c.progress.drains == 0 and c.progress.restarts == 1 and "draining->recovering" in c.progress.history
    assert all(d.startswith("l/") for d in groups[1].plan.devices())
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}  # same losses as an uninterrupted run
    drain = c.progress.events[0]
    assert drain["kind"] == "drain" and "snapshot_s" not in drain and drain["met_deadline"] is False


def test_a_staged_drain_the_job_finishes_before_its_switch_closes_its_event():
    """A notice whose switch is staged but not yet made when the last step commits leaves an event
    with the whole timeline's end (first_step_s None: no step ran on its plan), and says why it ended."""
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    notice = Notice(node="a", deadline_s=120.0, source="aws")
    c, log, groups = make(FakeNodes(BIG), snapshot_every=100, steps=5, group_kw={"stages_switch": True,
                                                                                   "ready_after": 99},
                          interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    drain = c.progress.events[0]
    assert drain["kind"] == "drain" and "switch_s" not in drain and len(groups) == 1  # never switched
    assert drain["first_step_s"] is None and drain["met_deadline"] is True
    assert drain["ended"] == "the job ended before the switch"
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}


def test_notice_too_close_to_the_deadline_falls_back_to_recovery():
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    clock = FakeClock(tick=0.5)
    late = Notice(node="a", deadline_s=1.0, source="gcp")  # deadline already (nearly) here at poll 2
    c, log, groups = make(FakeNodes(BIG, SMALL), failures=[[3]], snapshot_every=1, steps=5,
                          interruptions=FakeInterruptions({2: [late]}), clock=clock)
    assert c.run() == State.DONE
    assert c.progress.drains == 0 and c.progress.restarts == 1  # the node's loss was recovered, not drained
    assert [e["kind"] for e in c.progress.events] == ["notice-too-close", "re-plan", "restore"]
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}  # the uncommitted step was redone, nothing lost


def test_notice_drains_when_the_copy_fits_not_by_step_time():
    """At a step boundary the step in flight is committed: the time left must cover copying the step to
    keepers off the doomed nodes (bytes over the links) plus the margin, however long a step takes."""
    from orchestrator.control.drain import notice_decision
    from orchestrator.control.protocols import Notice

    notice = Notice(node="a", deadline_s=150.0, source="aws")
    assert notice_decision([notice], {"b"}, 100.0, 1.0, lambda doomed: 0.0) is None  # not the plan's node
    drain, mine, left = notice_decision([notice], {"a", "b"}, 100.0, 1.0, lambda doomed: 40.0)
    assert drain and mine == [notice] and left == 50.0  # 100 s steps would not matter: the copy fits
    assert notice_decision([notice], {"a"}, 100.0, 1.0, lambda doomed: 49.5)[0] is False  # copy + margin > left


def test_notice_with_a_copy_longer_than_the_deadline_falls_back_to_recovery():
    from orchestrator.control.fakes import FakeClock, FakeInterruptions
    from orchestrator.control.protocols import Notice

    slow = ClusterSpec(nodes=[n.model_copy(update={"inter_node_bw_gb_s": 1e-6}) for n in BIG.nodes])  # 1 kB/s
    survivors = ClusterSpec(nodes=[n for n in slow.nodes if n.name == "l"])
    notice = Notice(node="a", deadline_s=120.0, source="aws")
    c, log, groups = make(FakeNodes(slow, survivors), failures=[[3]], snapshot_every=1, steps=5,
                          interruptions=FakeInterruptions({2: [notice]}), clock=FakeClock(tick=0.5))
    assert c.run() == State.DONE
    assert c.progress.drains == 0 and c.progress.restarts == 1
    assert c.progress.events[0]["kind"] == "notice-too-close"
    assert c.progress.losses == {s: 10.0 - s for s in range(5)}


def test_a_recovery_runs_with_the_garbage_collector_paused_and_turns_it_back_on():
    """From the failure to the new group's restore no automatic collection runs (at thousands of ranks they were a
    third of a recovery's controller CPU: planner.search.CollectionPause); training goes on with it on, and a
    collector the caller disabled stays disabled."""
    import gc

    seen = []
    c, _, _ = make(FakeNodes(BIG, SMALL), failures=[[2]], snapshot_every=1,
                   on_phase=lambda phase: seen.append((phase.split()[0], gc.isenabled())))
    assert gc.isenabled()
    assert c.run() == State.DONE
    assert gc.isenabled()
    after = seen[[p for p, _ in seen].index("training") + 1:]  # the phases after the first training
    assert after[0][0] == "discovering" and not any(on for p, on in after if p in ("discovering", "planning",
                                                                                  "placing", "restoring"))
    assert after[-1] == ("done", True)  # the steps trained after the restore ran with it on
    gc.disable()
    try:
        c, _, _ = make(FakeNodes(BIG, SMALL), failures=[[2]], snapshot_every=1)
        assert c.run() == State.DONE and not gc.isenabled()
    finally:
        gc.enable()


def test_a_resume_that_cannot_read_its_run_fails_the_job_with_exit_2_and_trains_nothing():
    """The state plane's `ResumeError` (orchestrator/state/restore.py, the resume contract): no step trained, the
    job failed with the one line, exit code 2 (the user's to fix), not a re-plan."""
    from orchestrator.control.snapshots import MemorySnapshots
    from orchestrator.errors import ResumeError

    class Unreadable(MemorySnapshots):
        def restore(self, group, avoid=frozenset()):
            raise ResumeError("cannot resume run r1 from s3://b/job: step 7: AccessDenied; nothing was trained")

    c, log, _ = make(FakeNodes(BIG), store=Unreadable(1))
    assert c.run() == State.FAILED
    assert c.exit_code == 2 and "cannot resume run r1" in c.error and c.progress.losses == {}
    assert c.progress.restarts == 0


def test_a_second_writer_of_a_run_fails_the_job_with_exit_2_before_any_worker_starts():
    """The state plane's `WriterConflict` (another job writes this run's S3 steps): exit 2 with its one line, no
    worker group made, nothing trained."""
    from orchestrator.control.snapshots import MemorySnapshots
    from orchestrator.errors import WriterConflict

    class Taken(MemorySnapshots):
        def claim(self):
            raise WriterConflict("run r1 of job 'j' is being written to s3://b/job by another job (host h, pid 7, "
                                 "started 2026-12-06 04:00:00 UTC): one run has one writer")

    c, log, groups = make(FakeNodes(BIG), store=Taken(1))
    assert c.run() == State.FAILED
    assert c.exit_code == 2 and "one run has one writer" in c.error and c.progress.losses == {} and groups == []


def test_a_job_whose_writer_lock_another_job_took_stops_at_the_next_step_boundary_with_exit_2():
    """Another job took the run over mid-run (its writer lock: a renewal or a manifest's check found it taken):
    whatever this job trains now could be kept nowhere, so it stops at the next step boundary with exit 2 and the
    lock's reason, its workers ended; it does not train on."""
    from orchestrator.control.snapshots import MemorySnapshots

    class TakenOver(MemorySnapshots):
        steps_seen = 0

        def after_step(self, group, step, avoid=frozenset()):
            self.steps_seen = step + 1
            return super().after_step(group, step, avoid)

        def writer_lost(self):
            return ("run r1's writer lock at s3://b/job/.hetspot-writers/run-r1.json was taken by another writer: "
                    "this job writes no more steps of the run") if self.steps_seen >= 3 else None

    c, log, groups = make(FakeNodes(BIG), steps=10, store=TakenOver(1))
    assert c.run() == State.FAILED
    assert c.exit_code == 2 and "taken by another writer" in c.error and "stopped after step 2" in c.error, c.error
    assert sorted(c.progress.losses) == [0, 1, 2] and log[-1] == ("shutdown",), log


def test_an_evaluation_a_failure_interrupted_is_redone_on_the_restored_step(monkeypatch):
    """A node lost while the validation loss of committed step 2 is evaluated: after the recovery restores step 2,
    its evaluation is redone on those weights before step 3 trains (it was lost before), and the losses are the
    uninterrupted run's."""
    from orchestrator.errors import WorkerFailure

    real, failed = FakeGroup.evaluate, []

    def evaluate(self, batches):
        if not failed and self.applied == 3:
            failed.append(self.applied)
            raise WorkerFailure("rank 1 (pipeline 0, stage 0, A100-80GB on a)", "node lost", "node lost")
        return real(self, batches)

    monkeypatch.setattr(FakeGroup, "evaluate", evaluate)
    c, log, groups = make(FakeNodes(BIG, SMALL), steps=7, train=TrainSpec(global_batch=8, eval_every=3),
                          snapshot_every=1)
    assert c.run() == State.DONE and c.progress.restarts == 1 and failed == [3] and len(groups) == 2
    assert sorted(c.progress.val_losses) == [2, 5, 6], c.progress.val_losses
    assert c.progress.val_losses[2] == 20.0 - 3  # the committed weights of step 2, restored
    (e,) = [e for e in c.progress.events if e["kind"] == "evaluation"]  # its row went out before: the event says it
    assert e["step"] == 2 and e["val_loss"] == 17.0 and "restored" in e["cause"]
    assert c.progress.losses == {s: 10.0 - s for s in range(7)}


def test_the_validation_loss_is_evaluated_between_steps_every_eval_every_and_after_the_last():
    c, log, _ = make(FakeNodes(BIG), steps=7, train=TrainSpec(global_batch=8, eval_every=3))
    assert c.run() == State.DONE
    assert sorted(c.progress.val_losses) == [2, 5, 6]  # after steps 3 and 6 (1-based) and the job's last
    assert c.progress.val_losses[2] == 20.0 - 3  # the committed weights of step 2: three steps applied
