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
    RESTORE_SOURCE = "restore source failed"  # a holder did not hold what it said it held (not S3's fault)

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


class Refusal(str, enum.Enum):
    """Why an S3 step is not used (orchestrator/state/manifest.py): the reader falls back to the previous good step.

    Only a step that is shown broken (`replaceable`) may be deleted and written again by its own run's redo; a step
    that could not be read this time (denied, throttled) or cannot be attributed (malformed) is never deleted."""

    MISSING = "missing"  # a piece the manifest names is not in the bucket (a lifecycle rule, a hand delete)
    CORRUPT = "corrupt"  # a piece's bytes or tensors differ from what the manifest says
    NOT_WHOLE = "not whole"  # the manifest does not cover the model's every unit
    UNREADABLE = "unreadable"  # S3 refused or failed the read (access denied, throttled past the retries)
    MALFORMED = "malformed"  # the manifest cannot be read as one (or its folder is not its step's)
    FOREIGN = "foreign"  # another job's, run's or model's step

    def __str__(self) -> str:
        return self.value

    @property
    def replaceable(self) -> bool:
        return self in (Refusal.MISSING, Refusal.CORRUPT, Refusal.NOT_WHOLE)


class CheckpointError(Exception):
    """A step that cannot be used (`refusal` says why, `step` which one), or a checkpoint write that did not
    happen."""

    def __init__(self, message: str, refusal: Refusal | None = None, step: int | None = None):
        super().__init__(message)
        self.refusal, self.step = refusal, step

    def __reduce__(self):  # crosses Ray's process boundary with its fields
        return (type(self), (str(self), self.refusal, self.step))


class WriterConflict(CheckpointError):
    """Another job is writing this run's steps (its writer lock is held and not lapsed): this one stops, exit 2,
    naming it, rather than overwrite its pieces."""


class ResumeError(CheckpointError):
    """A resumed run found none of its steps readable (after retrying what may pass): the job stops, exit 2,
    rather than train fresh weights under the run's name."""
