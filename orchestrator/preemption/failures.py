"""Failure kinds and their classification: pure functions of what the runtime observed (no Ray).

A lost node, a dead actor, a step or collective that timed out, or a collective
whose peer went away are *transient*: another plan on the survivors can go on.
Anything else a worker raises (bad data, a shape error, out of memory under this
plan's sizes) is *deterministic*: every plan would hit it again, so the job
aborts at once with the worker's message instead of re-planning (Ray Train v2's
failure policy makes the same split between retryable and user errors).
"""

from __future__ import annotations

import enum


class FailureKind(str, enum.Enum):
    NODE_LOST = "node lost"
    ACTOR_DIED = "actor died"
    TIMEOUT = "timeout"
    COLLECTIVE = "collective error"  # a peer vanished under a collective (gloo/NCCL connection errors)
    DETERMINISTIC = "error"  # the worker's own exception: re-running would raise it again


TRANSIENT = frozenset({FailureKind.NODE_LOST, FailureKind.ACTOR_DIED, FailureKind.TIMEOUT, FailureKind.COLLECTIVE})

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


def is_transient(kind: str) -> bool:
    return FailureKind(kind) in TRANSIENT
