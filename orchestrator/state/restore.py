"""`Restorer`: the state plane after a failure. `salvage` has survivors keep the committed step (in their own
processes in place, else in their node's keeper, tier live); `restore` asks the new workers what they need, the
keepers, kept processes and S3 manifests what they hold, runs the pure restore planner (restore_plan.py) and hands
each worker its transfers as typed requests to their sources (workers/transfer.py `Fetch`); the workers pull the
bytes themselves. A piece S3 refuses refuses that step, and the restore plans again at the previous one; a source
that did not hold what it said is the worker group's failure (a re-plan). Reports a `RestoreReport`.

A resume keeps its word: a run resumed from S3 (`resuming`) restores one of its own whole, readable steps, the
newest it can, or stops. Until its first restore, a listing S3 refuses and a piece whose read S3 refused
(denied, throttled: `Refusal.UNREADABLE`, which may pass) are tried again after `RETRY_S` pauses, each piece with
a budget of its own; a step shown broken (missing, corrupt, not whole) is passed over for the one before it; and
where none of the run's steps can be read the restore raises `ResumeError` (the job exits 2 naming the step, the
error and the fix) instead of training fresh weights under the run's name.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Set

from orchestrator.errors import FailureKind, Refusal, ResumeError, WorkerFailure
from orchestrator.state.keepers import RPC_TIMEOUT_S, KeeperSet, Received
from orchestrator.state.protocols import StateGroup
from orchestrator.state.restore_plan import TIERS, Holding, Need, RestorePlan, plan_restore, s3_holdings
from orchestrator.state.s3_store import Identity, S3Checkpoints, s3_code
from orchestrator.state.uploader import Uploader
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
    region,
)

log = logging.getLogger("hetspot.checkpoints")
LEASE_S = RPC_TIMEOUT_S * 10  # an S3 step being restored is not pruned for this long
RETRY_S = (1.0, 4.0, 15.0)  # a resume's pauses before it asks S3 again for what it refused (about 20 s in all)


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None


class Restorer:
    def __init__(self, keepers: KeeperSet, uploader: Uploader | None, s3: S3Checkpoints | None,
                 identity: Identity, keep: int, received: Received, restore_from: str = "nearest",
                 overlap: bool = True, resuming: bool = False, retry_s: tuple[float, ...] = RETRY_S,
                 sleep: Callable[[float], None] = time.sleep):
        self.keepers, self.uploader, self.s3, self.identity, self.keep = keepers, uploader, s3, identity, keep
        self.received, self.restore_from, self.overlap = received, restore_from, overlap
        self.resuming = resuming and s3 is not None  # until its first restore: a step of the run, or stop
        self.retry_s, self.sleep = retry_s, sleep
        self.last_restore: RestoreReport | None = None
        self.sourcing = False  # a restore's moments may still be pulled from the keepers (until the next step)
        self._refused: dict[int, str] = {}  # S3 steps the last restore refused, and why

    def _went_to(self, step: int) -> None:
        if self.uploader is not None:
            self.uploader.went_to(step)

    def salvage(self, group: StateGroup, avoid: Set[str] = frozenset(), step: int | None = None) -> None:
        """Survivors (off the `avoid` nodes) keep committed step `step` (None: the step each holds): in their own
        processes when the group recovers in place (nothing moves; a rank that cannot prove it holds that step
        is replaced), else handed to their own node's keeper (tier "live")."""
        if self.sourcing:  # the moments of the restore still being pulled come from the live tier
            group.settle_restore()
            self.sourcing = False
        group.recovery.keep(group, self.keepers, self.received, avoid, step)  # state/recovery.py

    def _s3_holdings(self) -> tuple[list[Holding], dict[int, float]]:
        """The complete S3 steps' pieces as Holdings; optimizer steps by step."""
        if self.s3 is None:
            return [], {}
        from botocore.exceptions import BotoCoreError, ClientError

        for pause in (*self.retry_s, None) if self.resuming else (None,):
            try:  # this run's good steps only: whole, every piece listed (another run's are never loaded)
                manifests, refused = self.s3.usable(self.identity, limit=self.keep)
                break
            except (BotoCoreError, ClientError) as e:
                if pause is None and self.resuming:
                    raise ResumeError(self._cannot_resume(f"listing its steps was refused ({s3_code(e)})")) from e
                if pause is None:
                    log.warning("cannot list checkpoints in %s: %s; restoring without the S3 tier", self.s3.uri, e)
                    return [], {}
                log.warning("listing %s was refused (%s); asking again in %.0f s (resuming run %s)", self.s3.uri,
                            s3_code(e), pause, self.identity.run_id)
                self.sleep(pause)
        for st in refused:
            if st.refusal is not Refusal.FOREIGN:
                self._refused[st.step] = st.reason
                if st.refusal is not None and st.refusal.replaceable and self.uploader is not None:
                    self.uploader.bad_steps.add(st.step)  # its redo replaces it in S3
        self.received.add(manifests)
        return s3_holdings(manifests)

    def restore(self, group: StateGroup, avoid: Set[str] = frozenset()) -> RestoreReport | None:
        """Restore the newest step every unit is available at, from the cheapest sources, none on the `avoid` nodes
        (doomed by a notice: they may go during the restore); None: nothing held."""
        t0 = time.perf_counter()
        group.holds_state = False
        self._refused = {}  # S3 steps this restore refused, and why
        needs_by_rank = group.needs()
        self.received.add(needs_by_rank)
        ranks = layout.ranks(group.plan)
        needs = [Need(i, ranks[i].node, n.unit, region(n.region), n.nbytes)
                 for i, rank_needs in enumerate(needs_by_rank) for n in rank_needs]
        kh, kopt, _ = self.keepers.holdings()
        ph, popt = group.recovery.holdings(group)  # in place: kept processes' memory, the cheapest source of all
        kh, kopt = ph + kh, popt | kopt
        kh = [h for h in kh if h.node not in avoid]
        # S3 is listed only when it may offer more: the keepers miss a unit, or this job uploaded a newer step.
        newest_upload = self.uploader.newest() if self.uploader is not None else -1
        near = plan_restore(needs, kh) if self.restore_from != "s3" else None
        skip_s3 = near is not None and near.step is not None and near.step >= newest_upload
        sh, sopt = ([], {}) if skip_s3 else self._s3_holdings()
        holdings, opt = kh + sh, sopt | kopt
        only = {Tier.S3} if self.restore_from == "s3" else None
        refused = self._refused
        tries: dict[tuple[int, str], int] = {}  # a resume's reads S3 refused, by step and refusal (a piece's read:
        # a refusal of another piece is progress, and has a budget of its own)
        while True:  # each turn refuses one more S3 step (or, resuming, asks again): it ends after the steps that exist
            usable = [h for h in holdings if not (h.tier == Tier.S3 and h.step in refused)]
            # the keepers' plan stands when nothing was added to what it was made from (no S3 listed, no refusal)
            rp = near if near is not None and not sh and only is None else plan_restore(needs, usable, only)
            if rp.step is None:
                if self.resuming:  # a run resumed from S3 never starts over
                    raise ResumeError(self._cannot_resume(
                        "; ".join(f"step {s}: {why}" for s, why in sorted(refused.items(), reverse=True)[:3])
                        or f"no step of it holds every unit (missing: {', '.join(rp.missing[:3])})"))
                if holdings:
                    log.warning("no step has every unit (missing at every step: %s); starting from step 0",
                                ", ".join(rp.missing[:5]) or "some units")
                group.holds_state = True  # its fresh initial state is the job's state now
                self._went_to(-1)
                return None
            per_rank = self._fetches(rp, len(ranks))
            t_load = time.perf_counter()
            from_s3 = any(t.source.tier == Tier.S3 for t in rp.transfers)
            lease = self.s3.lease(rp.step, LEASE_S) if from_s3 and self.s3 is not None else _nothing()
            with lease:  # an S3 step read from is not pruned under it
                results = group.load(per_rank, rp.step, opt[rp.step], self.s3.location if self.s3 is not None else None,
                                     self.overlap)
            self.received.add(results)
            errors = [r.refused for r in results if r.refused is not None]
            if not errors:
                break
            own = [r for r in errors if not r.refusal]
            if own:  # a source that did not hold what it said (not S3's fault): the controller re-plans
                raise WorkerFailure(f"restore of step {rp.step}", own[0].error, FailureKind.RESTORE_SOURCE)
            why = Refusal(errors[0].refusal)
            n = tries.get((rp.step, errors[0].error), 0)
            if self.resuming and why is Refusal.UNREADABLE and n < len(self.retry_s):  # it may pass: ask again
                tries[(rp.step, errors[0].error)] = n + 1
                log.warning("reading checkpoint step %d was refused (%s); asking again in %.0f s (resuming run %s)",
                            rp.step, errors[0].error, self.retry_s[n], self.identity.run_id)
                self.sleep(self.retry_s[n])
                continue
            log.warning("refusing checkpoint step %d (%s): %s; trying the previous complete step", rp.step, why,
                        errors[0].error)
            refused[rp.step] = errors[0].error
            if why.replaceable and self.uploader is not None:
                self.uploader.bad_steps.add(rp.step)  # its redo replaces it in S3 (a read denied or throttled: not)
        by_tier = {t: sum(r.bytes.get(t, 0) for r in results) for t in TIERS}
        in_place = sum(r.bytes.get(Tier.IN_PLACE, 0) for r in results)
        self.last_restore = RestoreReport(  # times: planning (sources listed), the slowest rank's pull and load, in all
            rp.step, next((str(t) for t in reversed(TIERS) if by_tier[t]), "in place" if in_place else "live"),
            sum(by_tier.values()), {str(t): n for t, n in by_tier.items()}, in_place, sorted(refused),
            {str(s): why for s, why in sorted(refused.items())},
            sorted({t.need.unit for t in rp.transfers if t.source.tier == Tier.S3}),
            round(t_load - t0, 3), round(time.perf_counter() - t0, 3), round(max(r.pull_s for r in results), 3),
            round(max(r.import_s for r in results), 3), sum(r.deferred_bytes for r in results))
        self.resuming = False  # the run's step is in the workers now: later restores may go back to what they hold
        group.holds_state = self.sourcing = True  # the new workers hold it (the moments once the first step waited
        # for them: `after_step` clears the live tier then); salvage refills it on a failure
        self._went_to(rp.step)
        log.info("restored step %d: bytes by tier %s in %.2f s", rp.step, by_tier, self.last_restore.restore_s)
        return self.last_restore

    def _cannot_resume(self, why: str) -> str:
        """One line: which run could not be resumed, why, what was not done, and the fix."""
        assert self.s3 is not None  # (resuming needs S3)
        return (f"cannot resume run {self.identity.run_id} from {self.s3.uri}: {why}; nothing was trained. Check the "
                f"credentials and the bucket policy (s3:ListBucket, s3:GetObject) and submit again with --resume, or "
                f"give checkpoint.uri a new prefix to start a new run")

    def _fetches(self, rp: RestorePlan, num_ranks: int) -> list[list[Fetch]]:
        """Each rank's transfers of restore plan `rp`, as requests to their sources: a kept process's memory (read
        in place when it is the rank's own), a shard a keeper holds, or an S3 piece that the keeper of the rank's
        node reads (once per node)."""
        per_rank: list[list[Fetch]] = [[] for _ in range(num_ranks)]
        ids = self.keepers.alive_nodes() if any(t.source.tier == Tier.S3 for t in rp.transfers) else {}
        for t in rp.transfers:
            o, unit = t.source.origin, t.need.unit
            if isinstance(o, ProcessSource):
                fetch = Fetch(unit, t.region, None if o.rank == t.need.rank else o.handle, KeptRequest(unit, t.region))
            elif isinstance(o, KeeperSource):
                fetch = Fetch(unit, t.region, self.keepers.keepers[o.node],
                              ShardRequest(o.tier, o.rank, unit, t.region))
            elif isinstance(o, S3Source):
                fetch = Fetch(unit, t.region, self.keepers.on([t.need.node], ids)[0], S3Request(o.piece, t.region))
            else:
                raise TypeError(f"no source of type {type(o).__name__}")
            per_rank[t.need.rank].append(fetch)
        return per_rank
