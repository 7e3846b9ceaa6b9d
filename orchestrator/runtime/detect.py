"""Where a lost node is detected: the first failure among a plan's calls, named and classified.

Every call the worker group makes to its TrainWorkers (a step, a commit, a state export) is gathered here
with a deadline. The first worker error, dead actor or timeout ends the wait at once with one
`WorkerFailure` that names the rank and stage; when nodes of the plan are gone from the Ray cluster, the
failure is NODE_LOST and names them. The kinds and the policy that reads them are pure
(orchestrator/control/failure.py); this file observes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from orchestrator.control.failure import FailureKind, classify_error
from orchestrator.errors import WorkerFailure


def gather(futures: list, what: str, timeout_s: float, describe: Callable[[int], str], plan_nodes: list[str],
           on_result: Callable[[object], None] = lambda r: None) -> list:
    """Results in rank order; the first failure raises a WorkerFailure with the rank's identity and kind."""
    index = {f: i for i, f in enumerate(futures)}
    results: list = [None] * len(futures)
    pending, deadline = list(futures), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            slow = ", ".join(describe(index[f]) for f in pending[:4])
            raise failure(what, f"did not finish within {timeout_s:.0f} s; still waiting on {slow}",
                          FailureKind.TIMEOUT, plan_nodes)
        f = ready[0]
        try:
            results[index[f]] = ray.get(f)
            on_result(results[index[f]])
        except RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            kind = classify_error(getattr(cause, "cause_type", type(cause).__name__), str(cause))
            raise failure(f"{what} failed", str(cause), kind, plan_nodes) from None
        except RayActorError as e:
            if "creation task" in str(e):  # the worker's constructor raised: any plan would too
                raise WorkerFailure(f"{what} failed", f"{describe(index[f])} could not start: "
                                    f"{creation_error(e)}", FailureKind.DETERMINISTIC) from None
            raise failure(f"{what} failed", f"{describe(index[f])} died ({type(e).__name__})",
                          FailureKind.ACTOR_DIED, plan_nodes) from None
    return results


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
