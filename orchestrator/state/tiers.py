"""`TieredState`: the controller's state plane on Ray. It moves metadata only.

Three tiers hold the committed training state (README.md, "When a node is lost"): 1. live: survivors'
shards, handed to their own node's keeper after a failure (`salvage`); 2. peer: every `peer_every` steps (the
job's `runtime.snapshot_every`) each worker copies its shards to a keeper on another node (`after_step`;
placement by `restore_plan.peer_placement`, again when nodes join or go); 3. S3: every `s3_every` steps (a
multiple of `peer_every`), the keepers upload one object per unit slice (a cover chosen by the restore planner,
so replicas are not uploaded twice), then the controller writes the manifest, last and once.
The cover is of the job's whole model (`model_units`), not of whatever the keepers still answer for: when a node's
loss took every copy of some unit, that step is not written (a step that exists is whole). One uploader thread
works the newest step only: a step due while another uploads waits in a single slot, and a newer one replaces it
(the older is dropped and its keepers' pins released), so uploads never fall behind by more than the one in flight
and the one waiting (`upload_lag`), and the job's end waits for those two at most. A restore that goes back to an
earlier step abandons the uploads of later steps queued before it: the state they copy is being redone, and their
peer copies are replaced by the redo's, so such a step is not written (its redo is uploaded in its turn).
After a (re)start, `restore` asks the new workers what they need and the keepers and S3 manifests what they hold,
runs the pure restore planner (orchestrator/state/restore_plan.py) and hands each worker its transfers; the workers
pull the bytes themselves (keeper -> worker through Ray's object store, S3 -> worker through boto3). The controller
sees unit names, regions, sizes and checksums, never tensors (`received_bytes`). A piece whose checksum fails
refuses that S3 step (a log line names the object); the restore plans again.

This file is the front: the peer snapshots and the controller's calls. The keepers as a set (keepers.py), the S3
uploader (uploader.py) and the restore (restore.py) are its three composed parts.
"""

from __future__ import annotations

import logging
from collections.abc import Set

from orchestrator.control.drain import replicated_off
from orchestrator.errors import FailureKind, WorkerFailure, WriterConflict
from orchestrator.state.calls import RayCalls, StateCalls
from orchestrator.state.keepers import RPC_TIMEOUT_S, KeeperSet, Received
from orchestrator.state.protocols import StateGroup
from orchestrator.state.restore import Restorer
from orchestrator.state.restore_plan import peer_placement
from orchestrator.state.s3_store import Identity, S3Checkpoints, WriterLock
from orchestrator.state.uploader import FLUSH_TIMEOUT_S, Uploader
from planner import layout
from workers.transfer import RestoreReport, Tier, UploadRecord

log = logging.getLogger("hetspot.checkpoints")


class TieredState:
    """The front of the state plane: the peer snapshots (placed here, copied by the workers to the keepers) and
    the controller's calls, over three composed parts: the keepers (`keepers.KeeperSet`: lifecycle, calls,
    inventories), the S3 uploader (`uploader.Uploader`: its thread, eras and pins; None without S3) and the
    restore (`restore.Restorer`: salvage and the restore loop)."""

    def __init__(self, peer_every: int = 1, s3: S3Checkpoints | None = None, *, s3_every: int = 10, keep: int = 3,
                 meta: dict | None = None, restore_from: str = "nearest", overlap: bool = True,
                 model_units: dict[str, list[int]] | None = None, calls: StateCalls | None = None,
                 resuming: bool = False, restorer_kw: dict | None = None) -> None:
        if s3 is not None and s3_every % peer_every:
            raise ValueError(f"s3_every ({s3_every} steps) must be a multiple of peer_every ({peer_every})")
        if s3 is not None and not model_units:
            raise ValueError("an S3 tier needs the model's units (model_units): a step is written only when whole")
        self.peer_every, self.s3, self.s3_every, self.keep = peer_every, s3, s3_every, keep
        self.meta = meta or {}
        self.model_units = dict(sorted((model_units or {}).items()))  # {unit: full shape}: the job's whole model
        # whose S3 steps this run counts, loads, replaces and prunes: its job, run (lineage) and model only
        self.identity = Identity.of(self.meta, self.model_units or None)
        self.received = Received()  # what the controller took in for state: metadata only
        self.keeper_set = KeeperSet(calls or RayCalls(), s3, self.received)
        self.uploader = None if s3 is None else Uploader(self.keeper_set, s3, self.identity, self.meta,
                                                           self.model_units, keep, self.received)
        # resuming: a run going on from its S3 steps restores one of them or stops (restore.py, the resume contract)
        self.restorer = Restorer(self.keeper_set, self.uploader, s3, self.identity, keep, self.received,
                                 restore_from, overlap, resuming, **(restorer_kw or {}))
        self.writer: WriterLock | None = None  # the run's writer lock in S3, once claimed
        self._receipts: list[tuple[int, list]] = []  # snapshots whose copies may still be in flight
        self._placed: tuple | None = None  # (group, (avoided, alive nodes), target nodes, keeper handles)

    # -- what the controller, drills and tests read ------------------------------------------------
    @property
    def calls(self) -> StateCalls:  # how keepers are reached: Ray, or in one process (calls.LocalCalls)
        return self.keeper_set.calls

    @calls.setter
    def calls(self, calls: StateCalls) -> None:
        self.keeper_set.calls = calls

    @property
    def keepers(self) -> dict[str, object]:  # node -> its keeper's handle
        return self.keeper_set.keepers

    @property
    def no_access(self) -> dict[str, str]:
        return self.keeper_set.no_access

    @property
    def _access(self) -> dict[str, object]:
        return self.keeper_set.access

    @property
    def received_bytes(self) -> int:
        return self.received.bytes

    @property
    def uploads(self) -> list[UploadRecord]:
        return self.uploader.uploads if self.uploader is not None else []

    @property
    def bad_steps(self) -> set[int]:
        return self.uploader.bad_steps if self.uploader is not None else set()

    @property
    def pruned(self) -> list:
        return self.uploader.pruned if self.uploader is not None else []

    @property
    def _inflight(self) -> int | None:
        return self.uploader.inflight if self.uploader is not None else None

    @property
    def last_restore(self) -> RestoreReport | None:
        return self.restorer.last_restore

    @property
    def restore_from(self) -> str:
        return self.restorer.restore_from

    @restore_from.setter
    def restore_from(self, v: str) -> None:
        self.restorer.restore_from = v

    @property
    def overlap(self) -> bool:
        return self.restorer.overlap

    @overlap.setter
    def overlap(self, v: bool) -> None:
        self.restorer.overlap = v

    # -- the run's one writer --------------------------------------------------------------
    def claim(self) -> None:
        """Before the first launch: this job as the one writer of its run's S3 steps (the lock renews itself and is
        checked before every manifest). WriterConflict (exit 2) where another job holds it; S3 refusing the lock
        now is said and the job goes on without it (each manifest write is still checked)."""
        if self.s3 is None or self.writer is not None or not self.meta.get("run_id"):
            return
        try:
            self.writer = self.s3.claim_writer(self.meta["run_id"], self.meta.get("job"))
        except WriterConflict:
            raise
        except Exception as e:  # noqa: BLE001
            log.warning("could not take the run's writer lock (%s: %s); going on without it", type(e).__name__, e)
            return
        if self.uploader is not None:
            self.uploader.writer = self.writer

    def writer_lost(self) -> str | None:
        """Why the run's writer lock is no longer this job's (another job took the run over: its renewal or a
        manifest's check found it so), or None."""
        return self.writer.lost if self.writer is not None else None

    def release(self) -> None:
        """At the job's end (done or failed): the lock goes, so the run's next job need not wait for it to lapse."""
        if self.writer is not None:
            self.writer.release()
            self.writer = None

    # -- snapshots ------------------------------------------------------------------------
    def after_step(self, group: StateGroup, step: int, avoid: Set[str] = frozenset()) -> bool:
        if self.restorer.sourcing:  # a step is committed: every rank has its moments, the live copies can go
            self.restorer.sourcing = False
            self.keeper_set.call_all("clear", Tier.LIVE)
            group.recovery.committed(group)
        if (step + 1) % self.peer_every:
            return False
        self.snapshot(group, step, avoid)
        return True

    def drain(self, group: StateGroup, step: int, avoid: set[str]) -> None:
        """Keep committed step `step` where a restore finds it without the `avoid` nodes (a notice's doomed nodes;
        none before a move to a larger plan). When stages off them hold every layer the stages on them hold (other
        replicas do: drain.replicated_off), nothing crosses a link; else every rank's state is first copied to
        keepers off them, and waited for. Then the survivors hand their state to their own node's keeper (tier
        "live"), so a stage that stays where it was reads it from its own node."""
        if avoid and not replicated_off(group.plan, avoid):
            self.snapshot(group, step, avoid, wait=True)
        self.salvage(group, avoid, step)

    def prepare_drain(self, group: StateGroup, avoid: set[str]) -> None:
        """A notice's pre-staged switch: start the keepers its drain will copy to (when stages off the `avoid`
        nodes do not hold every layer of theirs), so the switch does not wait for their processes to start."""
        if not avoid or replicated_off(group.plan, avoid):
            return
        ids = self.keeper_set.alive_nodes()
        candidates = sorted(set(ids) - set(avoid))
        if candidates:
            spans = layout.rank_spans(group.plan)
            self.keeper_set.on(peer_placement(spans, candidates, [b - a for _, a, b in spans]), ids, wait=False)

    def drain_ready(self) -> bool:
        """Every keeper started for a drain runs (never blocks)."""
        return self.keeper_set.all_started()

    def suspend(self, group: StateGroup, step: int) -> str:
        """Before the job gives every GPU back (a higher-priority job takes them): committed step `step` copied to
        the keepers (they run on no GPU) and, where the run has a bucket, uploaded to S3 and waited for. The
        resume reads the peer copies first where they remain, else S3. Says where the step is kept."""
        self.snapshot(group, step, wait=True, upload=self.s3 is not None)
        if self.uploader is None:
            return "the peer tier (no S3 bucket)"
        self.flush()
        lag = self.upload_lag(step) or {}
        if lag.get("newest_step") != step:
            log.warning("suspending: step %d is not in S3 (%s); the peer copies hold it", step, lag)
            return "the peer tier (its upload did not complete)"
        return "S3 and the peer tier"

    def snapshot(self, group: StateGroup, step: int, avoid: Set[str] = frozenset(), wait: bool = False,
                 upload: bool | None = None) -> None:
        try:
            keepers = self._targets(group, frozenset(avoid))
        except self.calls.lost as e:  # a keeper's node went while
            # this copy was placed: skip it (other tiers hold the step), forget the dead
            self.keeper_set.call_all("ping")
            self._placed = None  # keepers, and place the next snapshot afresh
            log.warning("peer snapshot of step %d skipped: a keeper's node went (%s)", step, type(e).__name__)
            return
        if keepers is None:
            log.warning("no node outside %s to keep a snapshot of step %d on", sorted(avoid), step)
            return
        if upload is None:  # the S3 tier's cadence
            upload = self.s3 is not None and (step + 1) % self.s3_every == 0
        refs = group.snapshot(step, keepers, pin=upload)
        self._check_receipts(step, refs)
        if wait:
            try:
                receipts = self.calls.get(refs, timeout=RPC_TIMEOUT_S)
            except self.calls.lost as e:  # a drain's copy, and a doomed node went before it landed
                self._placed = None
                raise self._copy_failed(group, step, e) from e
            self.received.add(receipts)
            if any(r is None for r in receipts):
                log.warning("the drain snapshot of step %d is incomplete", step)
        if upload and self.uploader is not None:
            self.uploader.enqueue(step, refs)

    def _copy_failed(self, group: StateGroup, step: int, e: Exception) -> WorkerFailure:
        """A copy the drain waits for failed: a rank or its keeper went (a node went before its deadline, or the
        copy took longer than the deadline left). The controller re-plans from what is left, as after any loss;
        the failure names the plan's nodes gone from the cluster (NODE_LOST) when there are any."""
        gone = sorted(set(group.plan.nodes()) - set(self.calls.alive_nodes()))
        kind = FailureKind.NODE_LOST if gone else FailureKind.TIMEOUT if "Timeout" in type(e).__name__ \
            else FailureKind.ACTOR_DIED
        cause = f"a rank or its keeper went before the copy landed ({type(e).__name__})"
        return WorkerFailure(f"drain snapshot of step {step}", cause, kind, gone)

    def _targets(self, group: StateGroup, avoid: frozenset) -> list | None:
        """Each rank's peer keeper, placed once per group (and again after a copy failed or a keeper was lost)."""
        ids = self.keeper_set.alive_nodes()  # a node that joined gets copies too: it holds nothing live, the best peer
        candidates = sorted(set(ids) - avoid)
        if self._placed is not None and self._placed[0] is group and self._placed[1] == (avoid, tuple(candidates)) \
                and all(n in self.keepers for n in self._placed[2]):
            return self._placed[3]
        if not candidates:
            return None
        spans = layout.rank_spans(group.plan)
        targets = peer_placement(spans, candidates, [b - a for _, a, b in spans])  # bytes ~ layers held
        self.keeper_set.on([n for n, _, _ in spans if n in ids and n not in avoid], ids, wait=False)  # for a salvage
        self._placed = (group, (avoid, tuple(candidates)), targets, self.keeper_set.on(targets, ids))
        return self._placed[3]

    def wait_snapshots(self, timeout_s: float = RPC_TIMEOUT_S) -> None:
        """Wait until the peer snapshots already asked for have landed or failed. Training never waits for them
        (a failure before one lands rolls back to an earlier step); a drill or test whose fault needs the newest
        committed step in the keepers waits for it here instead of for a while."""
        refs = [r for _, rs in self._receipts for r in rs]
        if refs:
            self.calls.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def _check_receipts(self, step: int, refs: list) -> None:
        """Hold the newest snapshot's receipts; say so when an earlier snapshot did not complete."""
        done = [r for s, rs in self._receipts for r in rs]
        if done:
            ready, _ = self.calls.wait(done, num_returns=len(done), timeout=0)
            for s, rs in self._receipts:
                if all(r in ready for r in rs):
                    try:
                        if any(x is None for x in self.calls.get(rs)):
                            log.warning("the peer snapshot of step %d is incomplete", s)
                    except Exception as e:  # a worker or keeper gone: that snapshot is incomplete
                        log.warning("the peer snapshot of step %d failed: %s", s, type(e).__name__)
                        self._placed = None  # place the next one afresh
            self._receipts = [(s, rs) for s, rs in self._receipts if not all(r in ready for r in rs)]
        self._receipts.append((step, refs))

    # -- S3 and recovery: the composed parts ------------------------------------------------------------
    def upload_lag(self, committed: int) -> dict | None:
        """Where the S3 tier stands after `committed` (Uploader.upload_lag); None without S3."""
        return None if self.uploader is None else self.uploader.upload_lag(committed)

    def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait for the upload in flight and the one waiting (at the end of a job, so its last step is in S3)."""
        if self.uploader is not None:
            self.uploader.flush(timeout_s)

    def salvage(self, group: StateGroup, avoid: Set[str] = frozenset(), step: int | None = None) -> None:
        """Survivors keep their committed state (tier live) before their group goes. A salvage that fails is said
        and costs bytes, not the job: the other tiers still hold the state."""
        try:
            self.restorer.salvage(group, avoid, step)
        except Exception as e:  # noqa: BLE001
            log.warning("salvaging survivors' state failed: %s", e)

    def restore(self, group: StateGroup, avoid: Set[str] = frozenset()) -> RestoreReport | None:
        return self.restorer.restore(group, avoid)
