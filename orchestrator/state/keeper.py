"""`Keeper`: one node's host memory for training state (tiers "live" and "peer"), and its S3 uploader.

One keeper actor runs on every node of the job (orchestrator/state/tiers.py
starts them, pinned to their node). Workers hand it their shards, by
(tier, step, rank of the plan that wrote them):
  - "peer": every `runtime.snapshot_every` steps each worker copies its committed
    shards to the keeper of *another* node (Gemini, SOSP'23: checkpoints in
    peers' CPU memory), so one node's loss never takes a unit's live copies and
    its snapshot together when another placement exists;
  - "live": after a failure, each surviving worker hands the committed state it
    holds to its own node's keeper before the worker processes are replaced
    (AutoHet's local-first recovery: survivors' state is the cheapest source).
New workers pull exactly the regions the restore planner assigns them
(`get_many`), so bytes move keeper -> worker through Ray's object store and
never through the controller. Keepers also upload pieces to S3
(`upload`), off every training step, and report only metadata.

A keeper holds numpy arrays (workers hand it `to_numpy` shards) and never
imports torch (workers/shards.py; S3 pieces are read and written as numpy):
one per node, and a drain waits for the new nodes' keepers: with torch, one took
2.0 s to answer, not 0.6-0.9 s, and held 240 MiB more of the host memory it keeps
state in (bench/keeper_start.py).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import ray

# numpy (through workers.shards) comes in with the class, before the actor's threads deserialize arrays: Python
# imports numpy unsafely from several threads at once ("partially initialized module 'numpy._core.numeric'").
from workers.shards import KEYS, MOMENTS, cut, serve, shard_nbytes
from workers.transfer import (
    CheckpointLocation,
    HeldRow,
    Piece,
    PieceRequest,
    Receipt,
    Refused,
    S3Piece,
    S3Request,
    ShardRequest,
    Tier,
    UploadedPiece,
)

log = logging.getLogger("hetspot.keeper")
UPLOAD_PIECES = 8  # a keeper's pieces uploaded at once (each over its own connections: s3_store.CONNECTIONS)


class KeeperStore:
    """One node's keeper, as a plain object (unit tests use it so); `Keeper` is the same as a Ray actor."""

    def __init__(self, node: str, keep_peer_steps: int = 2):
        self.node, self.keep_peer_steps = node, keep_peer_steps
        self.lock = threading.Lock()
        self.held: dict[tuple[Tier, int, int], tuple[dict, float]] = {}  # (tier, step, rank) -> (shards, opt steps)
        self.moments_go = threading.Event()  # tests: an overlapped restore's moments wait for it (hold_moments)
        self.moments_go.set()
        self.uploads_go = threading.Event()  # tests: every upload waits for it (hold_uploads)
        self.uploads_go.set()
        self.pinned: set[int] = set()  # peer steps with an S3 upload to come: kept past keep_peer_steps
        self.s3_read: dict[str, Future] = {}  # S3 pieces read for this node's workers during one restore
        self.s3_lock = threading.Lock()  # guards s3_read: each piece is read once, pieces at once
        self.s3_store: tuple[CheckpointLocation, Any] | None = None  # the last S3 read's location and store

    def ping(self) -> str:
        return self.node

    def put(self, tier: Tier, step: int, rank: int, shards: dict, pin: bool = False) -> Receipt:
        """Keep a worker's shards; for "peer", only the newest `keep_peer_steps` steps stay, and
        pinned ones (an S3 upload of them is coming) until `unpin`."""
        opt = max((s["optimizer_steps"] for s in shards.values()), default=0.0)
        with self.lock:
            self.held[(Tier(tier), step, rank)] = (shards, opt)
            if pin:
                self.pinned.add(step)
            if tier == Tier.PEER:
                self._prune()
        return Receipt(self.node, Tier(tier), step, rank, sum(shard_nbytes(s) for s in shards.values()))

    def _prune(self) -> None:
        steps = sorted({s for t, s, _ in self.held if t == Tier.PEER}, reverse=True)[:self.keep_peer_steps]
        for key in [k for k in self.held if k[0] == Tier.PEER and k[1] not in steps and k[1] not in self.pinned]:
            del self.held[key]

    def unpin(self, step: int) -> None:
        with self.lock:
            self.pinned.discard(step)
            self._prune()

    def clear(self, tier: Tier) -> int:
        """Drop a tier (and the S3 pieces read for the last restore)."""
        self.s3_read = {}
        with self.lock:
            doomed = [k for k in self.held if k[0] == tier]
            for k in doomed:
                del self.held[k]
        return len(doomed)

    def inventory(self) -> list[HeldRow]:
        """What this keeper holds, as metadata: one row per (tier, step, rank, unit)."""
        with self.lock:
            items = list(self.held.items())
        return [HeldRow(unit, tuple(tuple(r) for r in s["slice"]), step, tuple(s["shape"]), opt, tier, rank,
                        shard_nbytes(s))
                for (tier, step, rank), (shards, opt) in items for unit, s in shards.items()]

    def get_many(self, requests: list[PieceRequest], step: int, s3: CheckpointLocation | None = None,
                 keys: tuple[str, ...] | None = None) -> list[Piece | Refused]:
        """The tensors of each requested region of `step`, cut here so only those bytes move.

        A `ShardRequest` reads a shard this keeper holds, only its tensors `keys` (None: all; an overlapped
        restore asks for the moments later, and `Piece.deferred` says how many bytes the keys left out hold); an
        `S3Request` a piece of the S3 checkpoint at `s3`, whole, read once per keeper and verified against the
        manifest's SHA256. A piece S3 refuses (missing, unreadable, corrupt) answers one `Refused` instead: the
        step is refused, not the worker.
        """
        keys = KEYS if keys is None else tuple(keys)
        if keys == MOMENTS and not self.moments_go.wait(timeout=120):
            raise TimeoutError("moments held for 120 s (hold_moments without release_moments)")
        out: list[Piece | Refused] = []
        for req in requests:
            if isinstance(req, S3Request):
                got = self._s3_piece(req, step, s3)
                if isinstance(got, Refused):
                    return [got]
                out.append(got)
                continue
            if not isinstance(req, ShardRequest):
                raise TypeError(f"a keeper answers ShardRequest and S3Request, not {type(req).__name__}")
            out += serve([req], keys, lambda r: self._shard(r, step), lambda r: r.tier)
        return out

    def _shard(self, req: ShardRequest, step: int) -> dict:
        with self.lock:
            return self.held[(req.tier, step, req.rank)][0][req.unit]

    def _s3_piece(self, req: S3Request, step: int, s3: CheckpointLocation | None) -> Piece | Refused:
        from orchestrator.state.s3_store import CheckpointError, S3Checkpoints

        piece: S3Piece = req.piece
        read = 0
        with self.s3_lock:  # one read per object per node, however many workers need it; other objects meanwhile
            if s3 is not None and (self.s3_store is None or self.s3_store[0] != s3):  # a boto3 client: ~0.2 s
                self.s3_store = (s3, S3Checkpoints.at(s3))
            found = self.s3_read.get(piece.key)
            mine = found is None
            pending: Future = Future() if found is None else found
            if mine:
                self.s3_read[piece.key] = pending
        if mine:
            try:
                if s3 is None or self.s3_store is None:
                    raise ValueError("an S3 piece was asked for without the checkpoint's location")
                got, read = self.s3_store[1].read_piece(step, piece.entry(), arrays="numpy")
                pending.set_result(got)
            except CheckpointError as e:
                log.error("restore of step %d: %s", step, e)
                pending.set_result(Refused(str(e), str(e.refusal or "corrupt")))
            except BaseException as e:
                pending.set_exception(e)
                with self.s3_lock:
                    self.s3_read.pop(piece.key, None)  # another asker tries again
                raise
        got = pending.result()
        if isinstance(got, Refused):
            with self.s3_lock:
                self.s3_read.pop(piece.key, None)  # refused this time: the next restore asks S3 again
            return got
        tensors = cut(got | {"slice": piece.region}, req.region)
        return Piece(Tier.S3, tensors, read)

    def hold_moments(self) -> None:
        """Tests: hold every later answer of an overlapped restore's moments until `release_moments`."""
        self.moments_go.clear()

    def release_moments(self) -> None:
        self.moments_go.set()

    def hold_uploads(self) -> None:
        """Tests and drills: hold every later upload until `release_uploads`, so a node can die mid-upload (or a
        test keep an upload in flight) on a machine of any speed."""
        self.uploads_go.clear()

    def release_uploads(self) -> None:
        self.uploads_go.set()

    def check_write(self, at: CheckpointLocation) -> str | None:
        """Can this node write the checkpoint bucket? None, or what S3 answered (with this node's credentials)."""
        from orchestrator.state.s3_store import S3Checkpoints

        try:
            return S3Checkpoints.at(at).check_write(self.node)
        except Exception as e:  # noqa: BLE001 - no client at all (no credentials, no endpoint)
            return f"{type(e).__name__}: {e}"

    def upload(self, step: int, pieces: list[ShardRequest], at: CheckpointLocation,
               run_id: str | None = None) -> list[UploadedPiece]:
        """Upload these regions of shards of `step` as S3 objects named for the run `run_id`; their manifest
        entries (metadata only)."""
        from orchestrator.state.s3_store import S3Checkpoints

        if not self.uploads_go.wait(timeout=120):
            raise TimeoutError("uploads held for 120 s (hold_uploads without release_uploads)")
        store = S3Checkpoints.at(at)

        def one(p: ShardRequest) -> UploadedPiece:
            with self.lock:  # the step stays pinned: the state plane unpins it when the upload ends (on every
                shard = self.held[(p.tier, step, p.rank)][0][p.unit]  # keeper, unless a redo waits: tiers._release)
            tensors = cut(shard, p.region)  # put_piece leaves out the keys it holds none of
            return UploadedPiece(p.unit, S3Piece.of(store.put_piece(step, p.unit, p.region, tensors, run_id)))

        if len(pieces) <= 1:
            return [one(p) for p in pieces]
        # Pieces at once (each large one in concurrent parts too): one S3 connection is far below a node's NIC.
        # The first failure ends the call (an unreachable bucket fails every piece alike): the pieces not started
        # are dropped and the call does not wait for the others' retries, so the keeper is free for a restore.
        pool = ThreadPoolExecutor(min(UPLOAD_PIECES, len(pieces)), thread_name_prefix="hetspot-s3-put")
        try:
            return [f.result() for f in [pool.submit(one, p) for p in pieces]]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


# one per node, pinned there by tiers.py
Keeper = ray.remote(num_cpus=0, max_concurrency=4)(KeeperStore)  # type: ignore[call-overload]
