"""Failures and what to do about them: the kinds, how a worker's exception is classified, and the policy.

A lost node, a dead actor, a step or collective that timed out, or a collective whose peer went away are
*transient*: another plan on the survivors can go on (`Replan`). Anything else a worker raises (bad data, a
shape error, out of memory on every plan) is *deterministic*: any plan would fail the same way (`Abort`). The
runtime observes (runtime/worker_group.py); these pure functions decide. Ray Train v2's controller does the
same: a failure policy returns a decision, the controller applies it and logs the cause. No Ray, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.errors import FailureKind, WorkerFailure  # noqa: F401 - FailureKind is read from here too

TRANSIENT = frozenset({FailureKind.NODE_LOST, FailureKind.ACTOR_DIED, FailureKind.TIMEOUT, FailureKind.COLLECTIVE,
                       FailureKind.RESTORE_SOURCE})


# Exception types and message fragments that torch.distributed raises when a peer goes away.
_COLLECTIVE_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


_COLLECTIVE_TEXT = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                    "socket timeout", "peer", "connection refused",
                    "application timeout", "pair closure")  # gloo's timeout of a pair, some builds' wording


# Ray's errors for a peer actor (a keeper, another worker) or its objects gone with a lost node.
_ACTOR_TYPES = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
                "ObjectFetchTimedOutError", "NodeDiedError")


def classify_error(exc_type: str, message: str) -> FailureKind:
    """Kind of an exception a worker raised, from its type name and message."""
    if exc_type in _ACTOR_TYPES:
        return FailureKind.ACTOR_DIED
    if exc_type in _COLLECTIVE_TYPES:
        return FailureKind.COLLECTIVE
    text = message.lower()
    if any(t in text for t in _COLLECTIVE_TEXT):
        return FailureKind.COLLECTIVE
    return FailureKind.DETERMINISTIC


def is_transient(kind: FailureKind | str) -> bool:
    return FailureKind(kind) in TRANSIENT


@dataclass(frozen=True)
class Replan:
    reason: str


@dataclass(frozen=True)
class Abort:
    reason: str


Decision = Replan | Abort


def loses_a_node(failure: WorkerFailure) -> bool:
    """Whether the failure came with a node gone: a loss the next plan works around by leaving the node out."""
    return failure.kind == FailureKind.NODE_LOST or bool(failure.nodes)


def failure_policy(failure: WorkerFailure, restarts: int, max_restarts: int,
                   user_plan: bool = False, replan_user_plan: bool = False,
                   stalled: int = 1, max_stalled: int = 5) -> Decision:
    """Re-plan after a transient loss while restarts remain; abort on a deterministic error at once.

    `stalled`: the failures in a row, this one included, that lost no node with no step committed between them
    (0 when this one lost a node). A transient kind that comes back that way on every new plan (a restore whose
    source keeps failing, a collective that times out on healthy nodes) is not a loss that re-planning gets
    past: the job stops at the `max_stalled`-th instead of spending `max_restarts` re-plans on it. Spot losses,
    however many in a row, each take a node and never count (SkyPilot's managed jobs likewise recover from
    preemptions without a limit, and restart after a user error only as often as `max_restarts_on_errors` says).

    A user-supplied plan is replaced by a planner plan only when the user said so
    (`hetspot submit --plan P --replan-on-loss`).
    """
    if not is_transient(failure.kind):
        return Abort(f"{failure} (an error that any plan would hit again: not re-planning)")
    if restarts >= max_restarts:
        return Abort(f"{failure} (gave up after {restarts} re-plans)")
    if stalled >= max_stalled:
        return Abort(f"{failure} ({stalled} failures in a row with no node lost and no step committed between "
                     "them: another plan does not get past it, so not re-planning; "
                     "runtime.max_failures_without_progress sets how many)")
    if user_plan and not replan_user_plan:
        return Abort(f"{failure} (the job runs the plan given with --plan; pass --replan-on-loss to let "
                     "hetspot re-plan on the surviving GPUs)")
    return Replan(str(failure))


@dataclass
class Streak:
    """The count `failure_policy` reads as `stalled`, kept by the controller across failures."""

    stalled: int = 0  # failures in a row that lost no node with no step committed between them
    commits: int = 0  # steps committed so far (a count that rollbacks do not lower)
    at_failure: int = 0  # `commits` when the last failure came

    def failed(self, failure: WorkerFailure) -> int:
        """Count a failure in; the streak it makes (0 when it lost a node)."""
        before = self.stalled if self.commits == self.at_failure else 0
        self.stalled = 0 if loses_a_node(failure) else before + 1
        self.at_failure = self.commits
        return self.stalled
