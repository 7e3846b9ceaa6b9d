"""What crosses the state plane's process boundaries, as both sides see it: one typed record per message.

Imported by the workers (workers/actor.py) and by the controller's side (orchestrator/state/ and runtime/), which
may import workers/ but not the reverse. Every call between the state plane (state/tiers.py), a worker group, the
keepers (state/keeper.py) and the workers carries these records, not tuples dispatched on their first field,
holder strings or dicts (tests/test_transfer_types.py walks those calls' annotations):

  tiers.py --Fetch(PieceRequest)--> worker --PieceRequest--> keeper | kept process --Piece | Refused--> worker
  worker --NeedRow, HeldRow, Receipt, KeptState, LoadReport--> tiers.py --RestoreReport, UploadRecord--> controller

The model is torchft's `CheckpointTransport` (one typed transport between a healthy replica and a recovering
one) and Ray Train v2's decisions that carry their payload; the names are this project's.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

Region = tuple[tuple[int, int], ...]  # per dimension [start, stop) of the full, unsharded tensor


def region(rows) -> Region:
    """A region from any nesting of pairs (JSON gives lists)."""
    return tuple((int(a), int(b)) for a, b in rows)


class Tier(StrEnum):
    """Where a restore's bytes come from, cheapest first. A StrEnum: it equals its name in events and JSON."""

    IN_PLACE = "in_place"  # the rank's own process kept it (in-place recovery): nothing moves
    LIVE = "live"  # a survivor's memory: its node's keeper, or another kept worker process
    PEER = "peer"  # a keeper's copy of a periodic snapshot, on another node
    S3 = "s3"  # the durable checkpoint


@dataclass(frozen=True)
class CheckpointLocation:
    """The S3 checkpoint location, one value from the job file (`checkpoint.uri`, `checkpoint.endpoint_url`) to
    the process that reads or writes the bytes."""

    uri: str
    endpoint_url: str | None = None


# -- what a worker asks a source for -------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardRequest:
    """A region of a shard a keeper holds: the copy rank `rank` of the writing plan put in tier `tier`."""

    tier: Tier
    rank: int
    unit: str
    region: Region


@dataclass(frozen=True)
class KeptRequest:
    """A region of the state a kept worker process holds in its own memory (in-place recovery)."""

    unit: str
    region: Region


@dataclass(frozen=True)
class S3Piece:
    """One object of an S3 checkpoint step, as its manifest lists it."""

    key: str
    region: Region
    bytes: int
    sha256: str
    tensors: tuple[tuple[str, str], ...] | None = None  # (name, dtype) per tensor; None in manifests before format 4
    optimizer_steps: float = 0.0  # the step's (the manifest's), so a piece is checked for the moments
    version: str | None = None  # the object version written, in a versioned bucket (read as that version)
    etag: str | None = None  # what S3 answered the PUT: a listing showing another ETag means it was replaced

    @classmethod
    def of(cls, entry: dict) -> S3Piece:
        """From a manifest entry (the JSON document S3 holds)."""
        declared = entry.get("tensors")
        return cls(entry["key"], region(entry["region"]), int(entry["bytes"]), entry["sha256"],
                   None if declared is None else tuple(sorted(declared.items())),
                   float(entry.get("optimizer_steps") or 0.0), entry.get("version"), entry.get("etag"))

    def entry(self) -> dict:
        """As the manifest lists it."""
        return {"key": self.key, "region": [list(r) for r in self.region], "sha256": self.sha256,
                "bytes": self.bytes} | ({} if self.tensors is None else {"tensors": dict(self.tensors)}) | (
            {"optimizer_steps": self.optimizer_steps} if self.optimizer_steps else {}) | (
            {"version": self.version} if self.version else {}) | ({"etag": self.etag} if self.etag else {})


@dataclass(frozen=True)
class S3Request:
    """A region of an S3 piece, which the keeper of the worker's node reads once (whole, checked) for its node."""

    piece: S3Piece
    region: Region


PieceRequest = ShardRequest | KeptRequest | S3Request


@dataclass
class Piece:
    """A source's answer to one request: the tensors cut to its region, the bytes that moved, and the bytes of the
    tensors left out (an overlapped restore asks for AdamW's moments later)."""

    tier: Tier
    tensors: dict[str, Any]
    bytes: int
    deferred: int = 0


@dataclass(frozen=True)
class Refused:
    """A request a source could not answer. With `refusal` (an S3 `Refusal`'s value) S3 refused the piece: the
    step is refused, not the worker; without, the source did not hold what it said."""

    error: str
    refusal: str | None = None


@dataclass(frozen=True)
class Fetch:
    """One transfer the restore planner gives a worker: a region of a unit, from `source` (a keeper's or a kept
    process's handle; None: the worker's own process)."""

    unit: str
    region: Region
    source: Any
    request: PieceRequest


# -- where a restore's pieces are held (the restore planner's sources) ---------------------------------------
@dataclass(frozen=True)
class KeeperSource:
    """A shard a node's keeper holds: the copy rank `rank` of the writing plan put in `tier` (live or peer)."""

    node: str
    tier: Tier
    rank: int


@dataclass(frozen=True)
class ProcessSource:
    """The state a kept worker process holds in its own memory (in-place recovery): the `index`-th kept process,
    rank `rank` of the new plan (None: idle, it only serves), reached through `handle`."""

    node: str
    index: int
    rank: int | None
    handle: Any = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class S3Source:
    """An object of an S3 checkpoint step."""

    piece: S3Piece


Source = KeeperSource | ProcessSource | S3Source


@dataclass(frozen=True)
class ProcessHolding:
    """One kept worker process, as a worker group lists them for a restore: its rank in the new plan (None: idle),
    node, handle and what it holds."""

    rank: int | None
    node: str
    handle: Any
    rows: tuple[HeldRow, ...]


# -- what workers and keepers report (metadata only) -------------------------------------------------------
@dataclass(frozen=True)
class NeedRow:
    """One unit a rank must be given to resume: its region and bytes (weights and both AdamW moments)."""

    unit: str
    region: Region
    nbytes: int


@dataclass(frozen=True)
class HeldRow:
    """One unit slice a source holds at `step`: a keeper's inventory row (`tier`, the writing plan's `rank`) or a
    kept process's (tier live, rank -1)."""

    unit: str
    region: Region
    step: int
    shape: tuple[int, ...]
    optimizer_steps: float
    tier: Tier = Tier.LIVE
    rank: int = -1
    nbytes: int = 0


@dataclass(frozen=True)
class Receipt:
    """A keeper took a rank's shards of `step` into `tier`."""

    node: str
    tier: Tier
    step: int
    rank: int
    nbytes: int


@dataclass(frozen=True)
class KeptState:
    """A worker process kept committed step `step` (-1: none) in its own memory for the next plan."""

    step: int
    pid: int
    bytes: int


@dataclass
class LoadReport:
    """A rank's restore: bytes by tier (those an overlapped restore still brings included), its times, or what
    refused it."""

    bytes: dict[Tier, int] = field(default_factory=dict)
    pull_s: float = 0.0
    import_s: float = 0.0
    deferred_bytes: int = 0
    refused: Refused | None = None


@dataclass(frozen=True)
class UploadedPiece:
    """A keeper wrote one piece of `unit` to S3."""

    unit: str
    piece: S3Piece


# -- what the state plane reports to the controller ------------------------------------------------------
@dataclass
class RestoreReport:
    """One restore: the step, the costliest tier it read, bytes by tier, what was refused, and its times (planning,
    the slowest rank's pull and load, in all)."""

    step: int
    tier: str
    bytes: int
    bytes_by_tier: dict[str, int]
    in_place_bytes: int = 0
    refused_steps: list[int] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    s3_units: list[str] = field(default_factory=list)
    plan_s: float = 0.0
    restore_s: float = 0.0
    pull_s: float = 0.0
    import_s: float = 0.0
    overlapped_bytes: int = 0

    def as_dict(self) -> dict:
        """For the run's events and JSON (tier names as plain strings)."""
        out = asdict(self)
        out["bytes_by_tier"] = {str(k): v for k, v in self.bytes_by_tier.items()}
        return out


@dataclass
class UploadRecord:
    """One S3 step the uploader took up: written, exists (a redo S3 already held whole), failed or dropped (a
    newer step replaced it while it waited)."""

    step: int
    status: str
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


_SCALARS = (int, float, bool, type(None))


def payload_bytes(obj) -> int:
    """Bytes of a value as it crosses a process boundary: tensors by their data, containers by their parts.
    torch is not imported for it: a value that holds a torch tensor was made in (or unpickled into) a process
    that has torch already, and the controller, which counts every rank's answers, otherwise never needs it.
    torch may also be in sys.modules half imported (another thread of the process importing it now): a value
    holding a tensor cannot exist before torch.Tensor does, so only a defined torch.Tensor is looked for."""
    import numpy as np

    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return _payload_bytes(obj, (np.ndarray,) if tensor is None else (tensor, np.ndarray))


def _payload_bytes(obj, arrays: tuple) -> int:
    if type(obj) in _SCALARS:  # most of a report's fields: counted as 8 bytes, without the checks below
        return 8
    # The rows ranks and keepers report by the thousand: the count below, without walking each field.
    if type(obj) is HeldRow:
        return len(obj.unit) + 16 * len(obj.region) + 8 * len(obj.shape) + len(obj.tier) + 4 * 8  # 4 scalars
    if type(obj) is NeedRow:
        return len(obj.unit) + 16 * len(obj.region) + 8
    if isinstance(obj, arrays):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, dict):
        return _parts_bytes(obj.keys(), arrays) + _parts_bytes(obj.values(), arrays)
    if isinstance(obj, (list, tuple, set, frozenset)):
        return _parts_bytes(obj, arrays)
    fields = _FIELDS.get(type(obj))
    if fields is None and hasattr(obj, "__dataclass_fields__"):
        fields = _FIELDS[type(obj)] = tuple(obj.__dataclass_fields__)
    if fields is not None:
        return _parts_bytes([getattr(obj, f) for f in fields], arrays)
    if hasattr(obj, "__dict__"):
        return _payload_bytes(vars(obj), arrays)
    return 8


def _parts_bytes(parts, arrays: tuple) -> int:
    """The bytes of a container's parts, scalars inline (an inventory of thousands of rows is mostly scalars)."""
    n = 0
    for x in parts:
        n += 8 if type(x) in _SCALARS else _payload_bytes(x, arrays)
    return n


_FIELDS: dict[type, tuple[str, ...]] = {}  # a dataclass's field names, by class


class StepError(RuntimeError):
    """A step failed on this rank; the message names the rank, stage and node (raised by workers/engine.py).

    `cause_type` is the original exception's type name, which the controller's failure classification reads (a
    collective error is transient, an IndexError is not). It lives here, not beside the engine, because the
    controller unpickles it: from a module that imports torch, every failed step a controller reads (or Ray reports
    as unhandled when a failure drops its answer) imported torch into the controller's process, seconds of CPU in
    the middle of a recovery."""

    def __init__(self, message: str, cause_type: str = ""):
        super().__init__(message)
        self.cause_type = cause_type

    def __reduce__(self) -> tuple:
        return (StepError, (str(self), self.cause_type))


@dataclass
class StepResult:
    """A rank's step, as the worker returns it to the controller every step (here, not in workers/engine.py, so
    the controller's process reads it without importing torch)."""

    step: int
    rank: int
    loss: float | None  # this replica's sum(loss_i) / B, reported by its last stage's TP rank 0
    num_samples: int
    time_s: float
    peak_mem_bytes: int
    extra: dict = field(default_factory=dict)
