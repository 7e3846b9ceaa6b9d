"""Where a lost node is detected: the first failure among a plan's calls, named and classified.

Every call the worker group makes to its TrainWorkers (a step, a commit, a state export) is gathered here
with a deadline. The first worker error, dead actor or timeout ends the wait at once with one
`WorkerFailure` that names the rank and stage; when nodes of the plan are gone from the Ray cluster, the
failure is NODE_LOST and names them. The kinds and the policy that reads them are pure
(orchestrator/control/failure.py); this file observes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from orchestrator.control.failure import FailureKind, classify_error
from orchestrator.errors import WorkerFailure

CAUSE_WAIT_S = 1.0  # after a collective error, how long other ranks' answers may name its cause
UNREAD_WAIT_S = 60.0  # how long the answers a failure leaves unread are waited for, to be read and dropped


def gather(futures: list, what: str, timeout_s: float, names: Sequence[str], plan_nodes: list[str]) -> list:
    """Results in rank order; the first failure raises a WorkerFailure with the rank's identity (`names`, per
    rank; a call past them, to a process that holds no rank, is named by its place) and kind.

    A failed rank closes its groups at once (Engine.drop_groups), so its peers' collective errors can arrive
    before its own answer: a collective error is held for up to CAUSE_WAIT_S while the other ranks answer, and
    an error that names a cause (a dead actor, a deterministic error) is raised instead."""
    index = {f: i for i, f in enumerate(futures)}
    results: list = [None] * len(futures)
    pending, deadline = list(futures), time.monotonic() + timeout_s
    held: WorkerFailure | None = None
    held_until = 0.0
    while pending:
        until = min(deadline, held_until) if held is not None else deadline
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, until - time.monotonic()))
        if not ready:
            read_later(pending)
            if held is not None:
                raise held
            slow = ", ".join(_name(names, index[f]) for f in pending[:4])
            raise failure(what, f"did not finish within {timeout_s:.0f} s; still waiting on {slow}",
                          FailureKind.TIMEOUT, plan_nodes)
        got = _answer(ready[0], index[ready[0]], what, names, plan_nodes, results)
        if got is None:
            continue
        if got.kind != FailureKind.COLLECTIVE:
            read_later(pending)
            raise got
        if held is None:
            held, held_until = got, time.monotonic() + CAUSE_WAIT_S
    if held is not None:
        raise held
    return results


def read_later(refs: list) -> None:
    """The answers a failure leaves unread (the survivors' errors from the collective the failed rank left, or
    late results) are read and dropped on a thread once they come: Ray reports an error that is never read as
    "Unhandled error", a survivor's traceback in the job's log at every recovery that says nothing the failure
    did not."""
    if not refs:
        return

    def read() -> None:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=UNREAD_WAIT_S)
        for r in ready:
            with contextlib.suppress(Exception):
                ray.get(r, timeout=0)

    threading.Thread(target=read, daemon=True, name="hetspot-unread-answers").start()


def _name(names: Sequence[str], i: int) -> str:
    return names[i] if i < len(names) else f"process {i} of the call"


def _answer(f: Any, i: int, what: str, names: Sequence[str], plan_nodes: list[str],
            results: list) -> WorkerFailure | None:
    """Store rank i's result; its failure, if it failed."""
    try:
        results[i] = ray.get(f)
        return None
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        kind = classify_error(getattr(cause, "cause_type", type(cause).__name__), str(cause))
        return failure(f"{what} failed", str(cause), kind, plan_nodes)
    except RayActorError as e:
        if "creation task" in str(e):  # the worker's constructor raised: any plan would too
            return WorkerFailure(f"{what} failed", f"{_name(names, i)} could not start: {creation_error(e)}",
                                 FailureKind.DETERMINISTIC)
        return failure(f"{what} failed", f"{_name(names, i)} died ({type(e).__name__})", FailureKind.ACTOR_DIED,
                       plan_nodes)


def failure(where: str, cause: str, kind: FailureKind, plan_nodes: list[str]) -> WorkerFailure:
    """The one failure event: NODE_LOST, naming the plan's nodes gone from the cluster, when there are any."""
    from orchestrator.cluster.discovery import node_ids

    if kind == FailureKind.DETERMINISTIC:
        return WorkerFailure(where, cause, kind)
    gone = sorted(set(plan_nodes) - set(node_ids()))
    return WorkerFailure(where, cause, FailureKind.NODE_LOST if gone else kind, gone)


def creation_error(e: Exception) -> str:
    """The last line of the constructor's traceback inside a RayActorError, which names the error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.split(":", 1)[0].endswith(("Error", "Exception"))]
    return errs[-1] if errs else lines[-1] if lines else type(e).__name__
