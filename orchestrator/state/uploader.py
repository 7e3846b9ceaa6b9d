"""`Uploader`: the S3 tier's writer. Every `s3_every` steps the state plane hands it a step whose peer copies are on
their way to the keepers; one thread works the newest step only (a step due while another uploads waits in a single
slot, and a newer one replaces it: the older is dropped and its keepers' pins released), so uploads never fall
behind by more than the one in flight and the one waiting (`upload_lag`), and the job's end waits for those two at
most (`flush`). The keepers upload a cover of the whole model chosen by the restore planner (replicas are not
uploaded twice); the manifest is written last and once, only when the keepers answering hold every unit at that
step. A restore that goes back before a step being uploaded (`went_to`: the era each upload was queued in) makes
that step not written: its state is redone. The newest `keep` good steps of this run are kept (`_prune`).
"""

from __future__ import annotations

import logging
import threading
import time

from orchestrator.state.keepers import RPC_TIMEOUT_S, KeeperSet, Received
from orchestrator.state.restore_plan import Need, plan_restore
from orchestrator.state.s3_store import CheckpointError, Identity, S3Checkpoints, WriterLock
from workers.transfer import KeeperSource, ShardRequest, Tier, UploadRecord

log = logging.getLogger("hetspot.checkpoints")
UPLOAD_TIMEOUT_S = 600.0  # the keepers' uploads of one step's pieces
FLUSH_TIMEOUT_S = 300.0  # the job's end waits this long for the upload in flight and the one waiting


class Uploader:
    def __init__(self, keepers: KeeperSet, s3: S3Checkpoints, identity: Identity, meta: dict,
                 model_units: dict[str, list[int]], keep: int, received: Received):
        self.keepers, self.s3, self.identity, self.meta = keepers, s3, identity, meta
        self.model_units, self.keep, self.received = model_units, keep, received
        self.uploads: list[UploadRecord] = []  # per S3 step taken up: what became of it
        self.pruned: list = []  # per prune that did not go cleanly: what it left (s3_store.Pruned), retried next time
        self.bad_steps: set[int] = set()  # S3 steps a restore refused: their redo replaces them
        self._cv = threading.Condition()  # guards the slot and the step in flight
        self._pending: tuple[int, list, int] | None = None  # the newest step waiting, its receipts and era
        self._rollbacks: list[int] = []  # the step each restore went to; an upload's era: how many came before it
        self.inflight: int | None = None
        self._uploader: threading.Thread | None = None
        self.writer: WriterLock | None = None  # the run's writer lock (TieredState.claim): checked before a manifest

    def newest(self) -> int:
        """The newest step this job wrote to S3 (or found whole there); -1: none."""
        return max((u.step for u in self.uploads if u.status in ("written", "exists")), default=-1)

    def enqueue(self, step: int, refs: list) -> None:
        """Give `step` to the uploader; a step still waiting (not in flight) is dropped for it: S3 gets the newest
        committed state, never old steps late."""
        with self._cv:
            if self._pending is not None:
                dropped = self._pending[0]
                self.uploads.append(UploadRecord(dropped, "dropped"))
                if dropped != self.inflight:  # else the upload in flight (a try of that step before a rollback)
                    self.keepers.unpin(dropped)  # (else it still reads its copies: it releases them when it ends)
                log.info("checkpoint step %d dropped: step %d is newer and the uploader is busy", dropped, step)
            self._pending = (step, refs, len(self._rollbacks))
            if self._uploader is None:
                self._uploader = threading.Thread(target=self._upload_loop, name="hetspot-s3", daemon=True)
                self._uploader.start()
            self._cv.notify_all()

    def _upload_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None)
                pending, self._pending = self._pending, None
                assert pending is not None
                step, refs, era = pending
                self.inflight = step
            try:
                self._upload(step, refs, era)
            finally:
                with self._cv:
                    self.inflight = None
                    self._cv.notify_all()

    def upload_lag(self, committed: int) -> dict:
        """Where the S3 tier stands after `committed`: the newest step in S3 this job wrote, the lag in steps
        behind it (committed + 1 when none), and the steps waiting or in flight (at most 2); None without S3."""
        if self.s3 is None:
            return None
        self.keepers.collect_access()
        newest = max((u.step for u in self.uploads if u.status in ("written", "exists")), default=None)
        with self._cv:
            backlog = [s for s in (self.inflight, self._pending and self._pending[0]) if s is not None]
        return {"newest_step": newest, "lag_steps": committed - (newest if newest is not None else -1),
                "backlog": len(backlog), "dropped": sum(u.status == "dropped" for u in self.uploads),
                "failed": sum(u.status == "failed" for u in self.uploads), "no_access": sorted(self.keepers.no_access)}

    def went_to(self, step: int) -> None:
        """A restore brought the workers to `step`: uploads of later steps queued before now are of state that is
        redone (`_check_not_rolled_back`). Recorded before the redo's first snapshot replaces their peer copies."""
        with self._cv:
            self._rollbacks.append(step)

    def _release(self, step: int) -> None:
        """An upload of `step` ended: the keepers may let its peer copies go, unless a redo of it waits its turn."""
        with self._cv:
            waiting = self._pending is not None and self._pending[0] == step
        if not waiting:
            self.keepers.call_all("unpin", step)

    def _check_not_rolled_back(self, step: int, era: int) -> None:
        """Raise when a restore since the upload of `step` was queued (its `era`) went back before `step`."""
        with self._cv:
            back = [r for r in self._rollbacks[era:] if r < step]
        if back:
            raise CheckpointError(f"step {step} was rolled back to step {back[0]} while it uploaded (its state is "
                                  "redone, its peer copies replaced by the redo's); not written")

    def _upload(self, step: int, refs: list, era: int = 0) -> None:
        """Once the peer copies of `step` are in, the keepers upload a cover of the whole model; the manifest last.
        Nothing is written when the keepers answering hold less than the whole model at `step`, or when a restore
        went back before `step` meanwhile (checked again after the pieces are read: a redo's copies come only
        after its restore, so pieces read before a check that passes are all of this try)."""
        t0 = time.perf_counter()
        c = self.s3
        try:
            try:
                receipts = self.keepers.calls.get(refs, timeout=RPC_TIMEOUT_S)
            except self.keepers.calls.lost as e:
                raise CheckpointError(f"a peer copy of step {step} was lost before it landed ({type(e).__name__}: "
                                      f"a rank or its keeper went); not written") from e
            self.received.add(receipts)
            if any(r is None for r in receipts):
                raise CheckpointError(f"the peer copies of step {step} are incomplete")
            exists = c.prepare_step(step, self.identity, bad=step in self.bad_steps) == "exists"
            self._check_not_rolled_back(step, era)
            if exists:
                self._release(step)  # a redone step that S3 already holds whole: nothing to write
                self.uploads.append(UploadRecord(step, "exists", 0, time.perf_counter() - t0))
                return
            holdings, opt, _ = self.keepers.holdings(tiers=(Tier.PEER,), step=step)
            needs = [Need(-1, "", unit, tuple((0, n) for n in shape), 0) for unit, shape in self.model_units.items()]
            cover = plan_restore(needs, holdings)
            if cover.step != step:
                held = {h.unit for h in holdings}
                lost = [u for u in self.model_units if u not in held] or cover.missing
                raise CheckpointError(f"the keepers left hold {len(self.model_units) - len(lost)} of the model's "
                                      f"{len(self.model_units)} units at step {step} (every copy of "
                                      f"{', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''} is gone); "
                                      "not written")
            by_node: dict[str, list[ShardRequest]] = {}
            for t in cover.transfers:
                o = t.source.origin
                assert isinstance(o, KeeperSource), o  # the cover is of peer copies: keepers' shards
                by_node.setdefault(o.node, []).append(ShardRequest(o.tier, o.rank, t.need.unit, t.region))
            run_id = self.meta.get("run_id")
            futures = {n: self.keepers.keepers[n].upload.remote(step, pieces, c.location, run_id)
                       for n, pieces in by_node.items()}
            entries = [u for got in self._uploaded(step, futures) for u in got]
            self.received.add(entries)
            pieces: dict[str, list] = {}
            for u in entries:
                pieces.setdefault(u.unit, []).append(u.piece.entry())
            self._check_not_rolled_back(step, era)  # its pieces are in S3 but no manifest names them: not a step
            if self.writer is not None:
                self.writer.check()  # another job took the run over: its pieces are its own, no manifest of ours
            manifest = c.write_manifest(step, self.model_units, pieces, opt.get(step, 0.0), self.meta,
                                        self.model_units)
            self.bad_steps.discard(step)
            self._prune()
            self._release(step)
            nbytes = sum(u["bytes"] for u in manifest["units"].values())
            self.uploads.append(UploadRecord(step, "written", nbytes, time.perf_counter() - t0))
            log.info("checkpoint step %d in %s: %d bytes from %d keepers in %.2f s", step, c.uri, nbytes,
                     len(by_node), time.perf_counter() - t0)
        except Exception as e:  # an upload failure costs a checkpoint, not the job; it is recorded
            self._release(step)
            self.uploads.append(UploadRecord(step, "failed", 0, time.perf_counter() - t0, str(e)))
            log.warning("checkpoint step %d to %s failed: %s", step, c.uri, e)

    def _uploaded(self, step: int, futures: dict) -> list:
        """The keepers' answers to their uploads of `step` (node -> ref). A keeper whose node went before it
        answered fails the upload naming that node: the cover was placed on keepers alive when it was chosen, and
        a node that goes after that leaves pieces no manifest will name (not written)."""
        deadline = time.monotonic() + UPLOAD_TIMEOUT_S
        got = []
        for node, ref in futures.items():
            try:
                got.append(self.keepers.calls.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except self.keepers.calls.lost as e:
                how = "did not answer" if "Timeout" in type(e).__name__ else "went"
                raise CheckpointError(f"the keeper on {node} {how} while it uploaded its pieces of step {step} "
                                      f"({type(e).__name__}); not written") from e
        return got

    def _prune(self) -> None:
        """Keep the newest `keep` good steps of this run; a prune that fails or leaves keys is recorded and logged,
        never counted against the upload (its step is written): the next prune tries again."""
        try:
            result = self.s3.keep_newest(self.keep, self.identity)
        except Exception as e:  # noqa: BLE001 - a listing refused or throttled: pruning waits for the next upload
            log.warning("pruning %s failed (%s: %s); the next upload's prune tries again", self.s3.uri,
                        type(e).__name__, e)
            self.pruned.append({"error": f"{type(e).__name__}: {e}"})
            return
        if result.failed:
            self.pruned.append({"failed": result.failed})

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait for the upload in flight and the one waiting (at the end of a job, so its last step is in S3)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending is None and self.inflight is None, timeout_s):
                raise TimeoutError(f"S3 uploads still running after {timeout_s:.0f} s")
