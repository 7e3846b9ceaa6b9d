"""A worker's peer copies and their receipts (workers/actor.py `snapshot`, `receipt`): each snapshot call is one
copy, sent by the receipt call made with it, to the keeper set when it was taken. A notice's or a yield's drain
copies the committed step again while the regular copy of that step may still wait for the worker's one
snapshot thread (under load it does): both must go."""

import threading
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


def test_a_drain_copy_taken_before_the_regular_copy_of_its_step_went_is_sent_too(monkeypatch):
    import ray

    from workers import state
    from workers.actor import TrainWorker

    worker = TrainWorker.__ray_actor_class__
    monkeypatch.setattr(state, "export_shards", lambda running: {"w": running.committed_step})
    monkeypatch.setattr(state, "to_numpy", lambda shards: shards)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)  # a keeper's put answers at once

    def keeper(name):
        return SimpleNamespace(put=SimpleNamespace(remote=lambda tier, step, rank, shards, pin: (name, step, shards)))

    me = SimpleNamespace(running=SimpleNamespace(committed_step=1, rank=0, where="rank 0"), puts={},
                         puts_ready=threading.Condition(), keeper=keeper("k1"),
                         config=SimpleNamespace(control_timeout_s=0.2))
    worker.snapshot(me, 1)  # the regular copy of step 1, for k1; its receipt has not run yet
    me.keeper = keeper("k2")  # the drain's keepers (set_keeper), off the doomed node
    worker.snapshot(me, 1)  # the drain's copy of the same step
    assert worker.receipt(me, 1) == ("k1", 1, {"w": 1})
    assert worker.receipt(me, 1) == ("k2", 1, {"w": 1})  # (was None, after waiting out the timeout)
    assert me.puts == {} and worker.receipt(me, 1, 0.05) is None  # nothing left: a third waits, then None
