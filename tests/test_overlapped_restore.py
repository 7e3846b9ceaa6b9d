"""An overlapped restore on one rank (gloo, world size 1, no Ray): the weights load before the first step,
AdamW's moments on a thread beside it (workers/restore.py `Restore.load`), and the step waits for them before
its update. The resumed run must be the uninterrupted one, step for step, in every optimizer placement."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from orchestrator.control.migration import WEIGHTS_SHARE
from planner import ModelSpec, TrainSpec
from tests.test_mixed_precision import B, _plan
from workers.data import make_dataset
from workers.engine import Engine, StepError
from workers.state import (
    MOMENTS,
    cut,
    export_shards,
    import_moments,
    import_pieces,
    local_region,
    needs,
)

pytestmark = pytest.mark.unit
# Two layers of the `small` preset's shape at a quarter of its width: what is restored (weights, moments, masters)
# is the same kinds of tensors whatever the size, and 16-bit matmuls are slow on a CPU without bf16 instructions.
MODEL = ModelSpec(name="restore-test", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, seq_len=64)


def engine(precision: str, dtype: torch.dtype, offload: dict) -> Engine:
    e = Engine(_plan(offload, MODEL), 0, MODEL, TrainSpec(global_batch=B, lr=0.01, precision=precision),
               make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0), dtype)
    e.connect_alone(30)
    return e


def pieces(shards: dict, e: Engine, keys) -> dict:
    return {n: [(local_region(e, n), cut(s, local_region(e, n), keys))] for n, s in shards.items()}


PLACEMENTS = [("fp32", torch.float32, {}), ("bf16", torch.bfloat16, {}),
              ("bf16", torch.bfloat16, {"offload_optimizer": True})]


@pytest.mark.parametrize("precision, dtype, offload", PLACEMENTS, ids=["fp32", "bf16", "bf16-optimizer-offload"])
def test_moments_that_arrive_during_the_first_step_resume_the_same_training(precision, dtype, offload):
    ref = engine(precision, dtype, offload)  # one engine at a time: each is the process group's world
    try:
        want = [ref.step(s).loss for s in range(2)]
        shards, opt = export_shards(ref), 2.0
        want += [ref.step(s).loss for s in range(2, 5)]
    finally:
        ref.close()
    b = engine(precision, dtype, offload)
    pool = ThreadPoolExecutor(1)
    try:
        weights = sum(s["param"].nbytes for s in shards.values())
        assert weights == pytest.approx(WEIGHTS_SHARE * sum(n.nbytes for n in needs(b)))  # the policy's share
        import_pieces(b, pieces(shards, b, ("param",)), opt)
        assert all(not st for st in b.optimizer_states())  # no moments yet

        order: list[str] = []
        waiting = threading.Event()

        def later():  # the moments arrive only once the step's update has asked for them
            assert waiting.wait(60), "the step never waited for the moments"
            import_moments(b, pieces(shards, b, MOMENTS), opt)
            order.append("moments in")

        pulled = pool.submit(later)

        class Watched:  # the engine's wait for the restore, seen
            def result(self, timeout=None):
                order.append("update waits")
                waiting.set()
                return pulled.result(timeout)

        b.restoring = Watched()
        first = b.step(2)
        assert order == ["update waits", "moments in"] and first.extra["restore_wait_s"] > 0
        got = [first.loss] + [b.step(s).loss for s in (3, 4)]
    finally:
        b.close(), pool.shutdown()
    assert got == want[2:]  # bit for bit: the moments were in place before the update


def test_a_failed_moments_pull_fails_the_step_and_the_rank_exports_nothing():
    """A keeper lost mid-pull: the step raises (the controller's failure path), and the half-restored rank
    refuses to export (a hand-over or snapshot of it would hold weights without their moments)."""
    e = engine("fp32", torch.float32, {})
    try:
        e.step(0)
        shards = export_shards(e)
        import_pieces(e, pieces(shards, e, ("param",)), 1.0)
        failed = ThreadPoolExecutor(1).submit(lambda: (_ for _ in ()).throw(ConnectionError("keeper gone")))
        e.restoring = failed
        with pytest.raises(StepError, match="keeper gone"):
            e.step(1)
        with pytest.raises(RuntimeError, match="incomplete"):
            export_shards(e)
    finally:
        e.close()


def test_the_worker_half_of_a_restore_pulls_from_a_keeper_and_its_own_memory_without_ray():
    """workers/restore.py `Restore.load`, as a TrainWorker runs it, over a keeper reached in-process: half the units
    come from a peer keeper's copy, half from what this process kept (in place, nothing moved); the weights load
    now and the moments on the restore's thread; the resumed run is the uninterrupted one."""
    from orchestrator.state.calls import LocalCalls
    from workers.restore import Kept, Restore
    from workers.state import to_numpy
    from workers.transfer import Fetch, KeptRequest, ShardRequest, Tier

    ref = engine("fp32", torch.float32, {})
    try:
        want = [ref.step(s).loss for s in range(2)]
        shards = to_numpy(export_shards(ref))
        want += [ref.step(s).loss for s in range(2, 4)]
    finally:
        ref.close()
    calls = LocalCalls(["n"])
    keeper = calls.start_keeper("n", "n")
    names = sorted(shards)
    peer = set(names[::2])
    calls.get(keeper.put.remote(Tier.PEER, 1, 0, {n: shards[n] for n in peer}))
    kept = Kept()
    kept.state = (1, {n: shards[n] for n in names if n not in peer})
    b = engine("fp32", torch.float32, {})
    try:
        fetches = [Fetch(n, local_region(b, n), keeper, ShardRequest(Tier.PEER, 0, n, local_region(b, n)))
                   if n in peer else Fetch(n, local_region(b, n), None, KeptRequest(n, local_region(b, n)))
                   for n in names]
        report = Restore(kept, lambda answer, timeout=None: answer.result()).load(b, 1, 2.0, fetches, None)
        assert report.refused is None and b.committed_step == 1
        assert report.bytes[Tier.PEER] > 0 and report.bytes[Tier.IN_PLACE] > 0 and report.bytes[Tier.S3] == 0
        assert report.deferred_bytes == 2 * sum(s["param"].nbytes for s in shards.values())  # the moments, after
        assert sum(report.bytes.values()) == sum(n.nbytes for n in needs(b))
        got = [b.step(s).loss for s in range(2, 4)]
        assert got == want[2:]  # bit for bit
    finally:
        b.close()


@pytest.mark.parametrize("precision, dtype, offload", PLACEMENTS, ids=["fp32", "bf16", "bf16-optimizer-offload"])
def test_a_survivor_keeps_its_own_state_without_a_host_copy_and_resumes_the_same_training(precision, dtype,
                                                                                           offload):
    """In-place DP recovery on one rank, as TrainWorker.retain and load_state run it: `Kept.keep` keeps the closed
    stage's committed step as the engine's own tensors (the test counts the tensors copied: none, on a host), the
    next plan's stage (same layers, same TP slice) loads them from this process (tier in_place), and the resumed
    run is the uninterrupted one, bit for bit."""
    from workers.restore import Kept, Restore
    from workers.transfer import Fetch, KeptRequest, Tier

    ref = engine(precision, dtype, offload)
    try:
        want = [ref.step(s).loss for s in range(5)]
    finally:
        ref.close()
    a = engine(precision, dtype, offload)
    try:
        got = [a.step(s).loss for s in range(2)]
        own = {n: [a.opt_params[n], a.optimizer_state(a.opt_params[n])] for n in a.module.params}
        kept = Kept()
        report = kept.keep(a, None)
    finally:
        a.close()
    assert report is not None and report.step == 1
    held = kept.state[1]
    storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    copies = [(n, k) for n, (q, st) in own.items() for k, t in (("param", q), ("exp_avg", st["exp_avg"]),
                                                               ("exp_avg_sq", st["exp_avg_sq"]))
              if storage(held[n][k]) != storage(t)]
    assert copies == [] and len(own) > 0  # the kept state is the old stage's own memory: no host copy
    b = engine(precision, dtype, offload)
    try:
        fetches = [Fetch(n, local_region(b, n), None, KeptRequest(n, local_region(b, n))) for n in sorted(held)]
        load = Restore(kept, lambda answer, timeout=None: answer.result()).load(b, 1, 2.0, fetches, None)
        assert load.refused is None and b.committed_step == 1
        assert sum(load.bytes.values()) == load.bytes[Tier.IN_PLACE] == sum(n.nbytes for n in needs(b))
        got += [b.step(s).loss for s in range(2, 5)]
    finally:
        b.close()
    assert got == want  # bit for bit
