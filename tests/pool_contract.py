"""The behaviour every `Processes` pool shares (state/processes.Pool), checked once and run against both pools:
state/fakes.LocalPool (tests/test_processes.py) and runtime/processes.WorkerPool on a Ray cluster with fake GPUs
(tests/test_recovery_ray.py). Nodes "a" (2 GPUs) and "b" (1 GPU) exist; "nowhere" does not."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any


def check_pool(pool: Any, ended: Callable[[Any], bool], ready_within_s: float = 0.0) -> None:
    # warm workers fill each node up to what is wanted, counting the group's busy ranks, never past `most`
    assert pool.warm_up(Counter({"a": 2, "b": 1}), 5, Counter({"a": 1})) == 2
    assert sorted(k.node for k in pool.warm) == ["a", "b"] and all(k.warm for k in pool.warm)
    assert pool.warm_up(Counter({"a": 2, "b": 1}), 5, Counter({"a": 1})) == 0  # already there: none more
    assert pool.warm_up(Counter({"nowhere": 1}), 1, Counter()) == 0  # a node that is not alive gets none
    assert pool.warm_up(Counter({"a": 9}), 0, Counter()) == 0  # `most` 0: nothing started
    until = time.monotonic() + ready_within_s
    while not pool.warm_ready():
        assert time.monotonic() < until, "warm workers did not start"
        time.sleep(0.2)

    # a rank takes a warm worker on its node; a rank whose node has none left gets None
    first = list(pool.warm)
    taken = pool.take([("a", (0, 2)), ("b", (0, 2)), ("a", (0, 2))])
    assert [k.node if k is not None else None for k in taken] == ["a", "b", None] and not pool.warm
    pool.give_back([k for k in taken if k is not None])  # a failed start: they go back, still warm
    assert sorted(k.node for k in pool.warm) == ["a", "b"] and pool.holding() == []

    # standing spares keep to the cluster's nodes: the one on a node that left ends, none more start past `count`
    assert pool.spares(Counter({"a": 2}), 1, Counter()) == 0
    assert [k.node for k in pool.warm] == ["a"]
    gone = [k for k in first if k.node == "b"]
    assert all(ended(k) for k in gone)

    # a process kept from a group with no committed step holds nothing; the idle ones end once no rank took them
    kept = pool.take([("a", (0, 2))])
    pool.keep(kept)
    assert pool.idle == kept and pool.holding() == [] and not any(ended(k) for k in kept)
    pool.end_idle()
    assert pool.idle == [] and all(ended(k) for k in kept)

    # warm workers asked back end by node; every process ends with the job
    assert pool.warm_up(Counter({"a": 1, "b": 1}), 2, Counter()) == 2
    assert pool.end_warm({"b", "nowhere"}) == 1 and [k.node for k in pool.warm] == ["a"]

    # another job asks for a node no rank uses: the warm workers and the kept processes no rank took there end
    assert pool.warm_up(Counter({"a": 1, "b": 1}), 2, Counter()) == 1  # b's again (a has one)
    (on_b,) = pool.take([("b", (0, 2))])
    pool.keep([on_b])
    assert pool.give_up({"b"}) == 1 and pool.idle == [] and ended(on_b) and [k.node for k in pool.warm] == ["a"]
    last = list(pool.warm)
    pool.end_all()
    assert pool.warm == [] and pool.idle == [] and all(ended(k) for k in last)
