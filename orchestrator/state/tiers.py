"""`TieredState`: the controller's state plane on Ray. It moves metadata only.

Three tiers hold the committed training state (README.md, "When a node is lost"): 1. live: survivors'
shards, handed to their own node's keeper after a failure (`salvage`); 2. peer: every `peer_every` steps (the job's `runtime.snapshot_every`) each worker
copies its shards to a keeper on another node (`after_step`; placement by `restore_plan.peer_placement`, again when
nodes join or go); 3. S3: every `s3_every` steps (a multiple of `peer_every`), the keepers upload one object per unit slice (a cover chosen
by the restore planner, so replicas are not uploaded twice), then the controller writes the manifest, last and once.
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
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from orchestrator.control.drain import replicated_off
from orchestrator.errors import FailureKind, Refusal, WorkerFailure
from orchestrator.state.calls import RayCalls
from orchestrator.state.restore_plan import (
    TIERS,
    Need,
    keeper_holdings,
    peer_placement,
    plan_restore,
    process_holdings,
    s3_holdings,
)
from orchestrator.state.s3_store import CheckpointError, Identity, S3Checkpoints
from planner import layout
from workers.transfer import (
    Fetch,
    KeeperSource,
    KeptRequest,
    ProcessSource,
    RestoreReport,
    S3Request,
    S3Source,
    ShardRequest,
    Tier,
    UploadRecord,
    payload_bytes,
    region,
)

log = logging.getLogger("hetspot.checkpoints")
RPC_TIMEOUT_S = 60.0


@contextlib.contextmanager
def _nothing():
    yield None


class TieredState:
    def __init__(self, peer_every: int = 1, s3: S3Checkpoints | None = None, *, s3_every: int = 10, keep: int = 3,
                 meta: dict | None = None, restore_from: str = "nearest", overlap: bool = True,
                 model_units: dict[str, list[int]] | None = None, calls=None):
        if s3 is not None and s3_every % peer_every:
            raise ValueError(f"s3_every ({s3_every} steps) must be a multiple of peer_every ({peer_every})")
        if s3 is not None and not model_units:
            raise ValueError("an S3 tier needs the model's units (model_units): a step is written only when whole")
        self.calls = calls or RayCalls()  # how keepers are reached: Ray, or in one process (calls.LocalCalls)
        self.peer_every, self.s3, self.s3_every, self.keep = peer_every, s3, s3_every, keep
        self.meta, self.restore_from, self.overlap = meta or {}, restore_from, overlap
        self.model_units = dict(sorted((model_units or {}).items()))  # {unit: full shape}: the job's whole model
        # whose S3 steps this run counts, loads, replaces and prunes: its job, run (lineage) and model only
        self.identity = Identity.of(self.meta, self.model_units or None)
        self.pruned: list = []  # per prune that did not go cleanly: what it left (s3_store.Pruned), retried next time
        self.bad_steps: set[int] = set()  # S3 steps a restore refused: their redo replaces them
        self._refused: dict[int, str] = {}  # S3 steps the last restore refused, and why
        self._sourcing = False  # a restore's moments may still be pulled from the keepers (until the next step)
        self.keepers: dict[str, object] = {}  # node -> its keeper's handle
        self.received_bytes = 0  # what the controller took in for state: metadata only
        self.uploads: list[UploadRecord] = []  # per S3 step the uploader took up: what became of it
        self.last_restore: RestoreReport | None = None
        self._cv = threading.Condition()  # guards the uploader's slot and the step in flight
        self._pending: tuple[int, list, int] | None = None  # the newest step waiting for the uploader, its refs and era
        self._rollbacks: list[int] = []  # the step each restore went to; an upload's era: how many came before it
        self._inflight: int | None = None
        self._uploader: threading.Thread | None = None
        self._receipts: list[tuple[int, list]] = []  # snapshots whose copies may still be in flight
        self._placed: tuple | None = None  # (group, (avoided, alive nodes), target nodes, keeper handles)
        self._starting: dict[str, object] = {}  # keepers started and not yet seen running
        self.no_access: dict[str, str] = {}  # nodes whose keeper cannot write the bucket: what S3 answered
        self._access: dict[str, object] = {}  # keepers' write checks not yet answered

    def _alive_nodes(self) -> dict[str, str]:
        return self.calls.alive_nodes()

    def _keepers_on(self, nodes: list[str], ids: dict[str, str], wait: bool = True) -> list:
        """The keepers of `nodes` (alive, in `ids`), started together where missing; with `wait`, running before
        anyone sends them state. A keeper is a process (seconds to start): a group's first snapshot starts them."""
        for n in dict.fromkeys(nodes):
            if n not in self.keepers:
                k = self.calls.start_keeper(n, ids[n])
                self.keepers[n], self._starting[n] = k, k.ping.remote()
                if self.s3 is not None:  # checked as it starts, with its own node's credentials
                    self._access[n] = k.check_write.remote(self.s3.location)
        if wait:
            pending = [self._starting.pop(n) for n in dict.fromkeys(nodes) if n in self._starting]
            self.calls.get(pending, timeout=RPC_TIMEOUT_S)
        return [self.keepers[n] for n in nodes]

    def _collect_access(self) -> None:
        """The keepers' write checks that have answered: a node that may not write the bucket is named as soon as
        its keeper started (its uploads would fail), not found out at the first upload. Never blocks."""
        if not self._access:
            return
        ready, _ = self.calls.wait(list(self._access.values()), num_returns=len(self._access), timeout=0)
        for node in [n for n, ref in self._access.items() if ref in ready]:
            try:
                err = self.calls.get(self._access.pop(node))
            except Exception:  # noqa: BLE001 - a keeper on a lost node
                continue
            if err is not None:
                self.no_access[node] = err
                log.warning("the keeper on %s cannot write %s (%s): that node's uploads will fail; give the node "
                            "credentials that may write the bucket (AWS: an instance profile)", node, self.s3.uri, err)

    def _call_keepers(self, method: str, *args, timeout_s: float = 10.0) -> dict[str, object]:
        """Call every keeper; those that do not answer (their node is gone) are forgotten."""
        refs = {node: getattr(k, method).remote(*args) for node, k in list(self.keepers.items())}
        ready, _ = self.calls.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for node, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:.0f} s")
                out[node] = self.calls.get(ref)
                self.received_bytes += payload_bytes(out[node])
            except Exception as e:  # a keeper on a lost node: what it held is gone
                log.info("keeper on %s is gone (%s); its state is not counted", node, type(e).__name__)
                self.keepers.pop(node, None), self._starting.pop(node, None)
        return out

    # -- snapshots ------------------------------------------------------------------------
    def after_step(self, group, step: int, avoid: set[str] = frozenset()) -> bool:
        if self._sourcing:  # a step is committed: every rank has its moments, the live copies can go
            self._sourcing = False
            self._call_keepers("clear", Tier.LIVE)
            if group.in_place:
                group.drop_retained()
        if (step + 1) % self.peer_every:
            return False
        self.snapshot(group, step, avoid)
        return True

    def drain(self, group, step: int, avoid: set[str]) -> None:
        """Keep committed step `step` where a restore finds it without the `avoid` nodes (a notice's doomed nodes;
        none before a move to a larger plan). When stages off them hold every layer the stages on them hold (other
        replicas do: drain.replicated_off), nothing crosses a link; else every rank's state is first copied to
        keepers off them, and waited for. Then the survivors hand their state to their own node's keeper (tier
        "live"), so a stage that stays where it was reads it from its own node."""
        if avoid and not replicated_off(group.plan, avoid):
            self.snapshot(group, step, avoid, wait=True)
        self.salvage(group, avoid, step)

    def prepare_drain(self, group, avoid: set[str]) -> None:
        """A notice's pre-staged switch: start the keepers its drain will copy to (when stages off the `avoid`
        nodes do not hold every layer of theirs), so the switch does not wait for their processes to start."""
        if not avoid or replicated_off(group.plan, avoid):
            return
        ids = self._alive_nodes()
        candidates = sorted(set(ids) - set(avoid))
        if candidates:
            spans = layout.rank_spans(group.plan)
            self._keepers_on(peer_placement(spans, candidates, [b - a for _, a, b in spans]), ids, wait=False)

    def drain_ready(self) -> bool:
        """Every keeper started for a drain runs (never blocks)."""
        pending = list(self._starting.values())
        ready, _ = self.calls.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        return len(ready) == len(pending)

    def snapshot(self, group, step: int, avoid: set[str] = frozenset(), wait: bool = False) -> None:
        try:
            keepers = self._targets(group, frozenset(avoid))
        except self.calls.lost as e:  # a keeper's node went while
            self._call_keepers("ping")  # this copy was placed: skip it (other tiers hold the step), forget the dead
            self._placed = None  # keepers, and place the next snapshot afresh
            log.warning("peer snapshot of step %d skipped: a keeper's node went (%s)", step, type(e).__name__)
            return
        if keepers is None:
            log.warning("no node outside %s to keep a snapshot of step %d on", sorted(avoid), step)
            return
        upload = self.s3 is not None and (step + 1) % self.s3_every == 0
        refs = group.snapshot(step, keepers, pin=upload)
        self._check_receipts(step, refs)
        if wait:
            receipts = self.calls.get(refs, timeout=RPC_TIMEOUT_S)
            self.received_bytes += payload_bytes(receipts)
            if any(r is None for r in receipts):
                log.warning("the drain snapshot of step %d is incomplete", step)
        if upload:
            self._enqueue(step, refs)

    def _targets(self, group, avoid: frozenset) -> list | None:
        """Each rank's peer keeper, placed once per group (and again after a copy failed or a keeper was lost)."""
        ids = self._alive_nodes()  # a node that joined gets copies too: it holds nothing live, the best peer
        candidates = sorted(set(ids) - avoid)
        if self._placed is not None and self._placed[0] is group and self._placed[1] == (avoid, tuple(candidates)) \
                and all(n in self.keepers for n in self._placed[2]):
            return self._placed[3]
        if not candidates:
            return None
        spans = layout.rank_spans(group.plan)
        targets = peer_placement(spans, candidates, [b - a for _, a, b in spans])  # bytes ~ layers held
        self._keepers_on([n for n, _, _ in spans if n in ids and n not in avoid], ids, wait=False)  # for a salvage
        self._placed = (group, (avoid, tuple(candidates)), targets, self._keepers_on(targets, ids))
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

    # -- the S3 uploader -------------------------------------------------------------------
    def _enqueue(self, step: int, refs: list) -> None:
        """Give `step` to the uploader; a step still waiting (not in flight) is dropped for it: S3 gets the newest
        committed state, never old steps late."""
        with self._cv:
            if self._pending is not None:
                dropped = self._pending[0]
                self.uploads.append(UploadRecord(dropped, "dropped"))
                if dropped != self._inflight:  # else the upload in flight (a try of that step before a rollback)
                    for k in list(self.keepers.values()):  # still reads its copies: it releases them when it ends
                        k.unpin.remote(dropped)
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
                (step, refs, era), self._pending, self._inflight = self._pending, None, self._pending[0]
            try:
                self._upload(step, refs, era)
            finally:
                with self._cv:
                    self._inflight = None
                    self._cv.notify_all()

    def upload_lag(self, committed: int) -> dict:
        """Where the S3 tier stands after `committed`: the newest step in S3 this job wrote, the lag in steps
        behind it (committed + 1 when none), and the steps waiting or in flight (at most 2); None without S3."""
        if self.s3 is None:
            return None
        self._collect_access()
        newest = max((u.step for u in self.uploads if u.status in ("written", "exists")), default=None)
        with self._cv:
            backlog = [s for s in (self._inflight, self._pending and self._pending[0]) if s is not None]
        return {"newest_step": newest, "lag_steps": committed - (newest if newest is not None else -1),
                "backlog": len(backlog), "dropped": sum(u.status == "dropped" for u in self.uploads),
                "failed": sum(u.status == "failed" for u in self.uploads), "no_access": sorted(self.no_access)}

    def _went_to(self, step: int) -> None:
        """A restore brought the workers to `step`: uploads of later steps queued before now are of state that is
        redone (`_check_not_rolled_back`). Recorded before the redo's first snapshot replaces their peer copies."""
        with self._cv:
            self._rollbacks.append(step)

    def _release(self, step: int) -> None:
        """An upload of `step` ended: the keepers may let its peer copies go, unless a redo of it waits its turn."""
        with self._cv:
            waiting = self._pending is not None and self._pending[0] == step
        if not waiting:
            self._call_keepers("unpin", step)

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
            receipts = self.calls.get(refs, timeout=RPC_TIMEOUT_S)
            self.received_bytes += payload_bytes(receipts)
            if any(r is None for r in receipts):
                raise CheckpointError(f"the peer copies of step {step} are incomplete")
            exists = c.prepare_step(step, self.identity, bad=step in self.bad_steps) == "exists"
            self._check_not_rolled_back(step, era)
            if exists:
                self._release(step)  # a redone step that S3 already holds whole: nothing to write
                self.uploads.append(UploadRecord(step, "exists", 0, time.perf_counter() - t0))
                return
            holdings, opt, _ = self._keeper_holdings(tiers=(Tier.PEER,), step=step)
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
                o: KeeperSource = t.source.origin
                by_node.setdefault(o.node, []).append(ShardRequest(o.tier, o.rank, t.need.unit, t.region))
            run_id = self.meta.get("run_id")
            futures = [self.keepers[n].upload.remote(step, pieces, c.location, run_id)
                       for n, pieces in by_node.items()]
            entries = [e for got in self.calls.get(futures, timeout=600) for e in got]
            self.received_bytes += payload_bytes(entries)
            pieces: dict[str, list] = {}
            for e in entries:
                pieces.setdefault(e.unit, []).append(e.piece.entry())
            self._check_not_rolled_back(step, era)  # its pieces are in S3 but no manifest names them: not a step
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

    def flush(self, timeout_s: float = 300.0) -> None:
        """Wait for the upload in flight and the one waiting (at the end of a job, so its last step is in S3)."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending is None and self._inflight is None, timeout_s):
                raise TimeoutError(f"S3 uploads still running after {timeout_s:.0f} s")

    # -- after a failure ----------------------------------------------------------------
    def salvage(self, group, avoid: set[str] = frozenset(), step: int | None = None) -> None:
        """Survivors (off the `avoid` nodes) keep committed step `step` (None: the step each holds): in their own
        processes when the group recovers in place (nothing moves; a rank that cannot prove it holds that step
        is replaced), else handed to their own node's keeper (tier "live")."""
        if self._sourcing:  # the moments of the restore still being pulled come from the live tier
            group.settle_restore()
            self._sourcing = False
        if group.in_place:  # even a group that failed before its restore: its processes still keep the step
            got = group.retain(step, avoid)
            self.received_bytes += payload_bytes(got)
            kept = [g for g in got if g is not None]
            log.info("%d of %d workers keep their committed state (step %s) in their own processes", len(kept),
                     len(got), sorted({g.step for g in kept}))
            return
        if not group.holds_state:
            return  # a group that failed before its state was restored holds nothing worth keeping
        ids = self._alive_nodes()
        self._call_keepers("clear", Tier.LIVE)
        ranks = layout.ranks(group.plan)
        keep = [r.node in ids and r.node not in avoid for r in ranks]
        alive = iter(self._keepers_on([r.node for r, k in zip(ranks, keep, strict=True) if k], ids))
        got = group.hand_over([next(alive) if k else None for k in keep])
        self.received_bytes += payload_bytes(got)
        kept = [g for g in got if g is not None]
        log.info("%d of %d workers handed their committed state (step %s) to their node's keeper", len(kept),
                 len(ranks), sorted({g.step for g in kept}))

    # -- restore --------------------------------------------------------------------------
    def _keeper_holdings(self, tiers=TIERS, step: int | None = None):
        """The keepers' holdings, as the restore planner's Holdings; optimizer steps by step, unit shapes."""
        return keeper_holdings(self._call_keepers("inventory"), tiers, step)

    def _s3_holdings(self):
        """The complete S3 steps' pieces as Holdings; optimizer steps by step."""
        if self.s3 is None:
            return [], {}
        from botocore.exceptions import BotoCoreError, ClientError

        try:  # this run's good steps only: whole, every piece listed (another run's are never loaded)
            manifests, refused = self.s3.usable(self.identity, limit=self.keep)
        except (BotoCoreError, ClientError) as e:
            log.warning("cannot list checkpoints in %s: %s; restoring without the S3 tier", self.s3.uri, e)
            return [], {}
        for st in refused:
            if st.refusal is not Refusal.FOREIGN:
                self._refused[st.step] = st.reason
                if st.refusal.replaceable:
                    self.bad_steps.add(st.step)  # its redo replaces it in S3
        self.received_bytes += sum(payload_bytes(m) for m in manifests)
        return s3_holdings(manifests)

    def restore(self, group, avoid: set[str] = frozenset()) -> RestoreReport | None:
        """Restore the newest step every unit is available at, from the cheapest sources, none on the `avoid` nodes
        (doomed by a notice: they may go during the restore); None: nothing held."""
        t0 = time.perf_counter()
        group.holds_state = False
        self._refused: dict[int, str] = {}  # S3 steps this restore refused, and why
        needs_by_rank = group.needs()
        self.received_bytes += payload_bytes(needs_by_rank)
        ranks = layout.ranks(group.plan)
        needs = [Need(i, ranks[i].node, n.unit, region(n.region), n.nbytes)
                 for i, rank_needs in enumerate(needs_by_rank) for n in rank_needs]
        kh, kopt, _ = self._keeper_holdings()
        if group.in_place:  # what kept processes hold in their own memory: the cheapest source of all
            ph, popt = process_holdings(group.held())
            kh, kopt = ph + kh, popt | kopt
        kh = [h for h in kh if h.node not in avoid]
        # S3 is listed only when it may offer more: the keepers miss a unit, or this job uploaded a newer step.
        newest_upload = max((u.step for u in self.uploads if u.status in ("written", "exists")), default=-1)
        near = plan_restore(needs, kh) if self.restore_from != "s3" else None
        skip_s3 = near is not None and near.step is not None and near.step >= newest_upload
        sh, sopt = ([], {}) if skip_s3 else self._s3_holdings()
        holdings, opt = kh + sh, sopt | kopt
        only = {Tier.S3} if self.restore_from == "s3" else None
        refused = self._refused
        while True:  # each turn refuses one more S3 step: it ends after the steps that exist
            usable = [h for h in holdings if not (h.tier == Tier.S3 and h.step in refused)]
            rp = plan_restore(needs, usable, only)
            if rp.step is None:
                if holdings:
                    log.warning("no step has every unit (missing at every step: %s); starting from step 0",
                                ", ".join(rp.missing[:5]) or "some units")
                group.holds_state = True  # its fresh initial state is the job's state now
                self._went_to(-1)
                return None
            per_rank = self._fetches(rp, len(ranks))
            t_load = time.perf_counter()
            from_s3 = any(t.source.tier == Tier.S3 for t in rp.transfers)
            with self.s3.lease(rp.step, RPC_TIMEOUT_S * 10) if from_s3 else _nothing():  # not pruned under it
                results = group.load(per_rank, rp.step, opt[rp.step], self.s3 and self.s3.location, self.overlap)
            self.received_bytes += payload_bytes(results)
            errors = [r.refused for r in results if r.refused is not None]
            if not errors:
                break
            own = [r for r in errors if not r.refusal]
            if own:  # a source that did not hold what it said (not S3's fault): the controller re-plans
                raise WorkerFailure(f"restore of step {rp.step}", own[0].error, FailureKind.RESTORE_SOURCE)
            why = Refusal(errors[0].refusal)
            log.warning("refusing checkpoint step %d (%s): %s; trying the previous complete step", rp.step, why,
                        errors[0].error)
            refused[rp.step] = errors[0].error
            if why.replaceable:
                self.bad_steps.add(rp.step)  # its redo replaces it in S3 (a read denied or throttled: not)
        by_tier = {t: sum(r.bytes.get(t, 0) for r in results) for t in TIERS}
        in_place = sum(r.bytes.get(Tier.IN_PLACE, 0) for r in results)
        self.last_restore = RestoreReport(  # times: planning (sources listed), the slowest rank's pull and load, in all
            rp.step, next((str(t) for t in reversed(TIERS) if by_tier[t]), "in place" if in_place else "live"),
            sum(by_tier.values()), {str(t): n for t, n in by_tier.items()}, in_place, sorted(refused),
            {str(s): why for s, why in sorted(refused.items())},
            sorted({t.need.unit for t in rp.transfers if t.source.tier == Tier.S3}),
            round(t_load - t0, 3), round(time.perf_counter() - t0, 3), round(max(r.pull_s for r in results), 3),
            round(max(r.import_s for r in results), 3), sum(r.deferred_bytes for r in results))
        group.holds_state = self._sourcing = True  # the new workers hold it (the moments once the first step waited
        # for them: `after_step` clears the live tier then); salvage refills it on a failure
        self._went_to(rp.step)
        log.info("restored step %d: bytes by tier %s in %.2f s", rp.step, by_tier, self.last_restore.restore_s)
        return self.last_restore

    def _fetches(self, rp, num_ranks: int) -> list[list[Fetch]]:
        """Each rank's transfers of restore plan `rp`, as requests to their sources: a kept process's memory (read
        in place when it is the rank's own), a shard a keeper holds, or an S3 piece that the keeper of the rank's
        node reads (once per node)."""
        per_rank: list[list[Fetch]] = [[] for _ in range(num_ranks)]
        ids = self._alive_nodes() if any(t.source.tier == Tier.S3 for t in rp.transfers) else {}
        for t in rp.transfers:
            o, unit = t.source.origin, t.need.unit
            if isinstance(o, ProcessSource):
                fetch = Fetch(unit, t.region, None if o.rank == t.need.rank else o.handle, KeptRequest(unit, t.region))
            elif isinstance(o, KeeperSource):
                fetch = Fetch(unit, t.region, self.keepers[o.node], ShardRequest(o.tier, o.rank, unit, t.region))
            elif isinstance(o, S3Source):
                fetch = Fetch(unit, t.region, self._keepers_on([t.need.node], ids)[0], S3Request(o.piece, t.region))
            else:
                raise TypeError(f"no source of type {type(o).__name__}")
            per_rank[t.need.rank].append(fetch)
        return per_rank
