"""The `Processes` seam (state/processes.py): the one pool logic, run here over the in-process fake
(state/fakes.LocalPool) and in tests/test_recovery_ray.py over runtime/processes.WorkerPool on Ray (the same
`tests/pool_contract.check_pool`), and restart's `NoProcesses`, whose versions do nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.state.fakes import LocalPool, LocalProcess
from orchestrator.state.processes import take_kept
from orchestrator.state.recovery import NoProcesses
from tests.pool_contract import check_pool

pytestmark = pytest.mark.unit


def test_the_in_process_pool_keeps_the_shared_contract():
    check_pool(LocalPool(["a", "b"]), lambda k: k.ended)


def kept(node: str, span: tuple[int, int], step: int = 3) -> LocalProcess:
    p = LocalProcess(node)
    p.span, p.retained = span, (step, {})
    return p


def test_a_rank_takes_the_kept_process_that_held_most_of_its_layers_before_any_warm_worker():
    pool = LocalPool(["a"])
    low, high = kept("a", (0, 2)), kept("a", (2, 5))
    pool.keep([low, high])
    pool.warm_up(Counter({"a": 3}), 1, Counter())  # two kept, one warm: three processes on a
    warm = pool.warm[0]
    got = pool.take([("a", (3, 5)), ("a", (0, 5)), ("a", (0, 1)), ("a", (0, 1))])
    assert got == [high, low, warm, None]  # most overlap first; a warm worker only when no kept one is left
    assert pool.idle == [] and pool.warm == []


def test_take_kept_breaks_ties_by_the_lowest_process_id_and_keeps_the_rest_in_order():
    a1, a2, b1 = kept("a", (0, 2)), kept("a", (0, 2)), kept("b", (0, 2))
    idle = [a2, b1, a1]
    assert take_kept(idle, [("a", (0, 2))]) == [min(a1, a2, key=lambda k: k.pid)]
    assert idle == [k for k in [a2, b1, a1] if k.pid != min(a1.pid, a2.pid)]


def test_only_processes_that_keep_a_committed_step_are_holdings():
    pool = LocalPool(["a"])
    holding, empty = kept("a", (0, 2)), LocalProcess("a")
    pool.keep([holding, empty])
    assert pool.holding() == [holding]


def test_restart_keeps_no_process_and_starts_no_warm_worker():
    none = NoProcesses()
    assert none.take([("a", (0, 2)), ("b", (0, 1))]) == [None, None]
    assert none.warm_up(Counter({"a": 4}), 4, Counter()) == 0 and none.spares(Counter({"a": 4}), 2, Counter()) == 0
    assert none.warm_ready() and none.holding() == [] and none.end_warm({"a"}) == 0
    stray = [LocalProcess("a"), LocalProcess("b")]
    none.keep(stray)  # a process handed to restart's processes is not kept: it ends
    assert all(p.ended for p in stray)
    none.end_idle()
    none.end_all()
