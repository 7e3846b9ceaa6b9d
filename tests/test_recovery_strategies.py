"""Each recovery strategy (state/recovery.py: `InPlace`, `Restart`) over the in-process fakes: the same loss under
both brings back the same committed step, in place from the survivor's own process with no byte moved, on restart
from its node's keeper (tier live) in a new process; what each keeps, reads and lets go of is the strategy's alone.
The strategies' shared pool behaviour runs against the fake and Ray in tests/pool_contract.py."""

from __future__ import annotations

import pytest

from orchestrator.state.calls import LocalCalls
from orchestrator.state.fakes import LocalGroup, LocalPool, model_units, values
from orchestrator.state.recovery import (
    STRATEGIES,
    InPlace,
    NoProcesses,
    Recovery,
    Restart,
    recovery,
    strategy_kind,
)
from orchestrator.state.tiers import TieredState
from planner import Pipeline, Plan, Stage

pytestmark = pytest.mark.unit
LAYERS = 4


def replicas(*nodes: str) -> Plan:
    return Plan(model_name="m", num_layers=LAYERS, global_batch=8, pipelines=[Pipeline(
        num_samples=8 // len(nodes), micro_batch_size=1, num_micro_batches=8 // len(nodes), stages=[
            Stage(layer_start=0, layer_end=LAYERS, gpu_type="L4", node=n, devices=[f"{n}/0"])]) for n in nodes])


def lose_b(mode: Recovery):
    """Two replicas on a and b train steps 0-3 with no snapshot; b dies; the survivor's state is salvaged, the
    group released and a one-replica plan on a restored."""
    calls = LocalCalls(["a", "b"])
    store = TieredState(100, None, model_units=model_units(LAYERS), calls=calls)
    old = LocalGroup(replicas("a", "b"), calls, mode)
    for step in range(4):
        old.commit(step)
        store.after_step(old, step)
    calls.kill("b")
    store.salvage(old, {"b"}, 3)
    old.release()
    new = LocalGroup(replicas("a"), calls, mode)
    return calls, store, old, new, store.restore(new, {"b"})


def holds(group: LocalGroup, step: int) -> bool:
    return all(all((sh[k] == values(step, u)[k]).all() for k in ("param", "exp_avg", "exp_avg_sq"))
               for units in group.shards for u, sh in units.items())


@pytest.mark.parametrize("mode", [InPlace(LocalPool()), Restart()], ids=["in-place", "restart"])
def test_the_same_loss_restores_the_same_step_under_either_strategy(mode):
    calls, store, old, new, r = lose_b(mode)
    assert r is not None and r.step == 3 and holds(new, 3)
    need = sum(n.nbytes for rank in new.needs() for n in rank)
    if mode.stages_switch:  # in place: the survivor's process is the new rank and reads its own memory
        assert new.pids == [old.pids[0]] and r.tier == "in place" and r.bytes == 0 and r.in_place_bytes == need
    else:  # restart: a new process reads what the survivor handed its node's keeper
        assert new.pids[0] not in old.pids and r.bytes_by_tier["live"] == need and r.in_place_bytes == 0
        assert all(p.ended for p in old.procs)


def test_in_place_lets_go_of_kept_copies_and_idle_processes_once_a_step_is_committed():
    pool = LocalPool()
    calls, store, old, new, _ = lose_b(InPlace(pool))
    spare = LocalGroup(replicas("a", "b"), calls, InPlace(LocalPool()))  # a process of another plan, kept idle
    spare.commit(3)
    spare.retain(3)
    pool.keep([spare.procs[0]])
    assert pool.holding() == [spare.procs[0]]
    new.commit(4)
    store.after_step(new, 4)  # every rank committed a step after the restore: InPlace.committed
    assert new.procs[0].retained is None and pool.idle == [] and spare.procs[0].ended


def test_restart_keeps_nothing_in_processes_and_reads_no_process_memory():
    mode = Restart()
    calls, store, old, new, r = lose_b(mode)
    assert isinstance(mode.processes, NoProcesses) and mode.holdings(new) == ([], {})
    assert old.retained is None  # no rank was asked to keep its step in its process
    mode.committed(new)  # nothing to let go of


def test_the_mode_names_one_strategy_and_a_wrong_one_says_the_fix():
    assert isinstance(recovery("in-place", LocalPool()), InPlace) and isinstance(recovery("restart"), Restart)
    assert InPlace(LocalPool()).stages_switch and not Restart().stages_switch
    with pytest.raises(ValueError, match="use in-place or restart"):
        recovery("resume")
    with pytest.raises(ValueError, match="pool"):
        recovery("in-place")


def test_the_fleet_simulator_charges_by_the_strategy_not_by_its_name():
    """drills/recovery_model.Assumptions names the mode (it is in the simulator's JSON) and reads what it charges
    for, process starts and a pre-staged switch, from the strategy that name stands for."""
    from orchestrator.drills.recovery_model import Assumptions

    for name, kind in STRATEGIES.items():
        a = Assumptions(recovery=name)
        assert strategy_kind(name) is kind and kind.name == name
        assert a.strategy is kind
    assert Assumptions().strategy.keeps_processes and not Assumptions(recovery="restart").strategy.keeps_processes
    with pytest.raises(ValueError, match="use in-place or restart"):
        Assumptions(recovery="resume")
