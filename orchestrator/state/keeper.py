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
"""

from __future__ import annotations

import logging
import threading
import time

import ray

log = logging.getLogger("hetspot.keeper")


class KeeperStore:
    """One node's keeper, as a plain object (unit tests use it so); `Keeper` is the same as a Ray actor."""

    def __init__(self, node: str, keep_peer_steps: int = 2):
        import workers.state  # noqa: F401  (torch: imported now, not on a recovery's path)

        self.node, self.keep_peer_steps = node, keep_peer_steps
        self.lock = threading.Lock()
        self.held: dict[tuple[str, int, int], tuple[dict, float]] = {}  # (tier, step, rank) -> (shards, opt steps)
        self.upload_delay_s = 0.0
        self.moments_go = threading.Event()  # tests: an overlapped restore's moments wait for it (hold_moments)
        self.moments_go.set()
        self.pinned: set[int] = set()  # peer steps with an S3 upload to come: kept past keep_peer_steps
        self.s3_read: dict[str, dict] = {}  # S3 pieces read for this node's workers during one restore
        self.s3_lock = threading.Lock()
        self.s3_store: tuple | None = None  # ((uri, endpoint), S3Checkpoints) of the last S3 read

    def ping(self) -> str:
        return self.node

    def put(self, tier: str, step: int, rank: int, shards: dict, pin: bool = False) -> dict:
        """Keep a worker's shards; for "peer", only the newest `keep_peer_steps` steps stay, and
        pinned ones (an S3 upload of them is coming) until `unpin`."""
        from workers.state import shard_nbytes

        opt = max((s["optimizer_steps"] for s in shards.values()), default=0.0)
        with self.lock:
            self.held[(tier, step, rank)] = (shards, opt)
            if pin:
                self.pinned.add(step)
            if tier == "peer":
                self._prune()
        return {"node": self.node, "tier": tier, "step": step, "rank": rank,
                "nbytes": sum(shard_nbytes(s) for s in shards.values())}

    def _prune(self) -> None:
        steps = sorted({s for t, s, _ in self.held if t == "peer"}, reverse=True)[:self.keep_peer_steps]
        for key in [k for k in self.held if k[0] == "peer" and k[1] not in steps and k[1] not in self.pinned]:
            del self.held[key]

    def unpin(self, step: int) -> None:
        with self.lock:
            self.pinned.discard(step)
            self._prune()

    def clear(self, tier: str) -> int:
        """Drop a tier (and the S3 pieces read for the last restore)."""
        self.s3_read = {}
        with self.lock:
            doomed = [k for k in self.held if k[0] == tier]
            for k in doomed:
                del self.held[k]
        return len(doomed)

    def inventory(self) -> list[dict]:
        """What this keeper holds, as metadata: one row per (tier, step, rank, unit)."""
        from workers.state import shard_nbytes

        with self.lock:
            items = list(self.held.items())
        return [{"tier": tier, "step": step, "rank": rank, "unit": unit, "region": [list(r) for r in s["slice"]],
                 "shape": list(s["shape"]), "nbytes": shard_nbytes(s), "optimizer_steps": opt, "node": self.node}
                for (tier, step, rank), (shards, opt) in items for unit, s in shards.items()]

    def get_many(self, requests: list[tuple], step: int, s3: tuple | None = None,
                 keys: tuple[str, ...] | None = None) -> list[dict]:
        """The tensors of each requested region of `step`, cut here so only those bytes move.

        A request is ("live" | "peer", rank, unit, region): a shard this keeper holds, only its
        tensors `keys` (None: all; an overlapped restore asks for the moments later, and
        "deferred" says how many bytes the keys left out hold); or ("s3", entry, region): a piece of the S3
        checkpoint (s3 = (uri, endpoint)), whole, read once per keeper and verified against the
        manifest's SHA256. Each answer is {"tier", "tensors", "bytes", "deferred"}; a piece S3 refuses
        (missing, unreadable, corrupt) answers {"error", "refusal"} instead: the step is refused, not the worker.
        """
        from orchestrator.state.s3_store import CheckpointError, S3Checkpoints
        from workers.state import KEYS, MOMENTS, answer, cut

        keys = KEYS if keys is None else tuple(keys)
        if keys == MOMENTS and not self.moments_go.wait(timeout=120):
            raise TimeoutError("moments held for 120 s (hold_moments without release_moments)")
        out = []
        for req in requests:
            if req[0] == "s3":
                entry, region = req[1], req[2]
                read = 0
                with self.s3_lock:  # one read per object per node, however many workers need it
                    if entry["key"] not in self.s3_read:
                        try:
                            if self.s3_store is None or self.s3_store[0] != s3:  # a boto3 client: ~0.2 s to make
                                self.s3_store = (s3, S3Checkpoints(*s3))
                            self.s3_read[entry["key"]], read = self.s3_store[1].read_piece(step, entry)
                        except CheckpointError as e:
                            log.error("restore of step %d: %s", step, e)
                            return [{"error": str(e), "refusal": str(e.refusal or "corrupt")}]
                tensors = cut({k: v.numpy() for k, v in self.s3_read[entry["key"]].items()} | {"slice": entry["region"]},
                              region)
                out.append({"tier": "s3", "tensors": tensors, "bytes": read, "deferred": 0})
                continue
            tier, rank, unit, region = req
            with self.lock:
                shard = self.held[(tier, step, rank)][0][unit]
            out.append(answer(shard, region, keys, tier))
        return out

    def delay_uploads(self, seconds: float) -> None:
        """Drills: hold every later upload this long first, so a test can kill a node mid-upload."""
        self.upload_delay_s = seconds

    def hold_moments(self) -> None:
        """Tests: hold every later answer of an overlapped restore's moments until `release_moments`."""
        self.moments_go.clear()

    def release_moments(self) -> None:
        self.moments_go.set()

    def check_write(self, uri: str, endpoint_url: str | None) -> str | None:
        """Can this node write the checkpoint bucket? None, or what S3 answered (with this node's credentials)."""
        from orchestrator.state.s3_store import S3Checkpoints

        try:
            return S3Checkpoints(uri, endpoint_url).check_write(self.node)
        except Exception as e:  # noqa: BLE001 - no client at all (no credentials, no endpoint)
            return f"{type(e).__name__}: {e}"

    def upload(self, step: int, pieces: list[tuple], uri: str, endpoint_url: str | None,
               run_id: str | None = None) -> list[dict]:
        """Upload [(tier, rank, unit, region)] of `step` as S3 objects named for the run `run_id`; their manifest
        entries (metadata only)."""
        import torch

        from orchestrator.state.s3_store import S3Checkpoints
        from workers.state import cut

        if self.upload_delay_s:
            time.sleep(self.upload_delay_s)
        store = S3Checkpoints(uri, endpoint_url)
        out = []
        for tier, rank, unit, region in pieces:  # the step stays pinned: the state plane unpins it when the upload
            with self.lock:  # ends (on every keeper, unless a redo of the step waits to upload: tiers._release)
                shard = self.held[(tier, step, rank)][0][unit]
            region = tuple(tuple(r) for r in region)
            tensors = {k: torch.from_numpy(v) for k, v in cut(shard, region).items() if v is not None}
            out.append({"unit": unit} | store.put_piece(step, unit, region, tensors, run_id))
        return out


Keeper = ray.remote(num_cpus=0, max_concurrency=4)(KeeperStore)  # one per node, pinned there by tiers.py
