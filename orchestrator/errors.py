"""User-facing errors. The CLI prints their message (no traceback) and exits with `exit_code`."""

from __future__ import annotations

import enum


class HetspotError(Exception):
    exit_code = 1


class ConfigError(HetspotError):
    """Bad user input: a job file, a plan file, data, or a flag. Exit code 2."""

    exit_code = 2


class JobFailed(HetspotError):
    """Training failed at run time; the message names the rank and stage."""

    exit_code = 1


class FailureKind(str, enum.Enum):
    """What a worker failure was; the failure policy (control/failure.py) reads it."""

    NODE_LOST = "node lost"
    ACTOR_DIED = "actor died"
    TIMEOUT = "timeout"
    COLLECTIVE = "collective error"  # a peer vanished under a collective (gloo/NCCL connection errors)
    DETERMINISTIC = "error"  # the worker's own exception: re-running would raise it again

    def __str__(self) -> str:  # in logs and events, the words
        return self.value


class WorkerFailure(HetspotError):
    """A worker or its node failed. The one error type from a worker fault to the controller (not the user's:
    the controller re-plans, or ends the job with `JobFailed` naming it).

    `where` names the phase and the rank (pipeline, stage, GPU type, node); `kind` is a `FailureKind`; `nodes`:
    the plan's nodes found gone from the cluster when it was raised.
    """

    def __init__(self, where: str, cause: str, kind: FailureKind | str = FailureKind.DETERMINISTIC,
                 nodes: list[str] | tuple = ()):
        super().__init__(f"{where}: {cause}")
        self.where, self.cause, self.kind, self.nodes = where, cause, FailureKind(kind), list(nodes)


class ControllerLost(HetspotError):
    """The job's controller (its Ray actor or process) died: what happened, the newest complete step, and the
    command that goes on from it. Exit code 1."""

    exit_code = 1


class CheckpointError(Exception):
    """A step that cannot be used: a missing or truncated manifest, or an object whose checksum is wrong."""
