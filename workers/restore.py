"""The worker's half of the state plane, apart from the Ray actor (workers/actor.py is its thin adapter):

- `serve`: the one shard server. A holder of shards (a node's keeper, orchestrator/state/keeper.py, or a kept
  worker process) answers piece requests with the regions cut from the shards it holds, the tensors asked for
  now and the bytes of those left for later.
- `Kept`: what an in-place survivor keeps in its own memory for the next plan (one committed step's shards), its
  rows for the restore planner, and its answers to the ranks that read it (itself included: tier in_place).
- `Restore`: pulling a rank's transfers from their sources and loading them; with the overlap, the weights now
  and AdamW's moments on a thread beside the first step's forward and backward (after AutoHete's priority by
  when each tensor is needed; the step's update waits for them, Engine.await_restore).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from workers.shards import serve
from workers.state import (
    MOMENTS,
    export_shards,
    import_moments,
    import_pieces,
    shard_nbytes,
)
from workers.transfer import (
    CheckpointLocation,
    Fetch,
    HeldRow,
    KeptRequest,
    KeptState,
    LoadReport,
    Piece,
    PieceRequest,
    Refused,
    S3Request,
    Tier,
)

if TYPE_CHECKING:
    from workers.engine import Engine


class Kept:
    """One committed step's shards an in-place survivor keeps for the next plan (None: nothing kept)."""

    def __init__(self) -> None:
        self.state: tuple[int, dict] | None = None  # (step, shards)

    def keep(self, engine: Engine | None, step: int | None) -> KeptState | None:
        """After a failure: keep committed step `step` (None: whatever step is committed) of `engine`, whose stage
        is let go of next (the caller closes it). Only a rank that proves it holds exactly that step is kept: its
        stage's committed step is `step`, no update was under way and no overlapped restore or update failed; or
        the stage never got state and the step kept from before is `step`. An overlapped update or restore that
        failed raises (its state is no step's); the caller keeps nothing then.

        The shards kept are the engine's own tensors where they live in host memory, not a copy (the engine is
        closed and never updates them again; the next plan's stage loads them from here, tier in_place, and
        peers read them through `answer`); a stage on a device leaves a host copy."""
        e, kept = engine, None
        if e is not None and e.built and not e.updating and e.incomplete is None \
                and step in (None, e.committed_step):
            kept = (e.committed_step, export_shards(e, copy=False) if e.committed_step >= 0 else {})  # settles
        elif self.state is not None and step in (None, self.state[0]):
            kept = self.state
        self.state = kept
        return self.report()

    def report(self) -> KeptState | None:
        if self.state is None:
            return None
        return KeptState(self.state[0], os.getpid(), sum(shard_nbytes(sh) for sh in self.state[1].values()))

    def rows(self) -> list[HeldRow]:
        """What it keeps, as a keeper's inventory rows (a source for the restore planner)."""
        if self.state is None:
            return []
        step, shards = self.state
        return [HeldRow(unit, tuple(tuple(r) for r in sh["slice"]), step, tuple(sh["shape"]), sh["optimizer_steps"])
                for unit, sh in shards.items()]

    def answer(self, requests: list[PieceRequest], step: int, keys: tuple[str, ...] | None,
               tier: Tier) -> list[Piece | Refused]:
        held = self.state
        if held is None or held[0] != step:
            # (an idle kept process has no stage, hence its process id)
            return [Refused(f"worker process {os.getpid()} keeps step {held and held[0]}, not step {step}")]
        bad = [type(r).__name__ for r in requests if not isinstance(r, KeptRequest)]
        if bad:
            raise TypeError(f"a kept process answers KeptRequest, not {bad[0]}")
        shards = held[1]
        pieces = serve(requests, keys, lambda r: shards[r.unit], lambda r: tier)
        if tier == Tier.IN_PLACE:  # this process's own loader: the kept tensors as they are
            return list(pieces)
        return [replace(p, tensors={k: _host_array(v) for k, v in p.tensors.items()}) for p in pieces]


def _host_array(t: Any) -> Any:
    """A kept tensor as Ray moves it to another process without pickling its data: a numpy array (the tensor's
    own memory where it is in host memory)."""
    return t.detach().cpu().numpy() if hasattr(t, "detach") else t


class Restore:
    """A rank's restores: `load` pulls its transfers and loads them into `engine`; `kept` answers the requests
    the rank makes of its own process (nothing moves). `get(answer, timeout)` waits for a source's answer (the
    actor passes `ray.get`: only the actor adapter imports Ray)."""

    def __init__(self, kept: Kept, get: Callable[..., Any], timeout_s: float = 300.0):
        self.kept, self.get = kept, get
        self.timeout_s = timeout_s  # one source's answer to a rank's requests (runtime.timeouts.transfer_s)
        self._pool: ThreadPoolExecutor | None = None

    def load(self, engine: Engine, step: int, optimizer_steps: float, transfers: list[Fetch],
             s3: CheckpointLocation | None, overlap: bool = True) -> LoadReport:
        """Pull this rank's state of `step` from its sources and load it (the restore planner's transfers).

        Each `Fetch`'s request is one its source's `get_many` takes (a shard a keeper holds, an S3 piece it reads
        for this node, or a kept process's state). With `overlap`, sources send the master weights now and
        AdamW's moments (two thirds of the bytes) on a thread beside the first step's forward and backward, which
        do not read them; the step waits for them before its update. S3 pieces come whole. Returns the bytes per
        tier, those still coming included (the thread checks them), or what refused it (an S3 object that fails
        its checksum)."""
        t0 = time.perf_counter()
        engine.await_restore(raise_error=False)  # a half-done earlier restore is superseded by this one
        engine.incomplete = None
        split = overlap and optimizer_steps > 0  # no moments before the first update
        got, nbytes, deferred = self._pull(transfers, step, s3, ("param",) if split else None)
        if isinstance(got, Refused):  # with a refusal: S3 refused the piece (the step is refused, not this worker)
            return LoadReport(nbytes, refused=got)
        t1 = time.perf_counter()
        import_pieces(engine, self._pieces(transfers, got), optimizer_steps)
        engine.committed_step = step
        rest = [t for t in transfers if not isinstance(t.request, S3Request)] if any(deferred.values()) else []
        if rest:
            engine.restoring = self._thread().submit(self._load_moments, engine, step, optimizer_steps, rest,
                                                     deferred)
        return LoadReport({t: nbytes[t] + deferred[t] for t in nbytes}, t1 - t0, time.perf_counter() - t1,
                          sum(deferred.values()))

    def _pull(self, transfers: list[Fetch], step: int, s3: CheckpointLocation | None,
              keys: tuple[str, ...] | None) -> tuple[dict[int, dict] | Refused, dict[Tier, int], dict[Tier, int]]:
        """({transfer index: tensors} or what refused it, bytes read per tier, bytes of the other keys per tier)."""
        by_source: dict = {}
        for i, t in enumerate(transfers):
            by_source.setdefault(t.source, []).append((i, t.request))
        futures: list[tuple[list, Any]] = [(reqs, k.get_many.remote([r for _, r in reqs], step, s3, keys))
                                           for k, reqs in by_source.items() if k is not None]
        if None in by_source:  # what this process kept itself: nothing moves (tier in place)
            own = by_source[None]
            futures.append((own, self.kept.answer([r for _, r in own], step, keys, Tier.IN_PLACE)))
        nbytes, deferred = dict.fromkeys(Tier, 0), dict.fromkeys(Tier, 0)
        got: dict[int, dict] = {}
        for reqs, fut in futures:
            answers = fut if isinstance(fut, list) else self.get(fut, timeout=self.timeout_s)
            if answers and isinstance(answers[0], Refused):
                return answers[0], nbytes, deferred
            for (i, _), a in zip(reqs, answers, strict=True):
                got[i] = a.tensors
                nbytes[a.tier] += a.bytes
                deferred[a.tier] += a.deferred
        return got, nbytes, deferred

    @staticmethod
    def _pieces(transfers: list[Fetch], got: dict[int, dict]) -> dict[str, list]:
        pieces: dict[str, list] = {}
        for i, t in enumerate(transfers):
            pieces.setdefault(t.unit, []).append((t.region, got[i]))
        return pieces

    def _load_moments(self, engine: Engine, step: int, optimizer_steps: float, transfers: list[Fetch],
                      expect: dict[Tier, int]) -> float:
        """The overlapped half of `load` (on its thread): the moments, checked against what the sources said they
        would send."""
        t0 = time.perf_counter()
        got, nbytes, _ = self._pull(transfers, step, None, MOMENTS)
        if isinstance(got, Refused):
            raise RuntimeError(f"{engine.where}: the moments of step {step} were refused: {got.error}")
        if nbytes != expect:
            raise RuntimeError(f"{engine.where}: the moments of step {step} came as {nbytes} bytes by tier, "
                               f"not the {expect} announced")
        import_moments(engine, self._pieces(transfers, got), optimizer_steps)
        return time.perf_counter() - t0

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetspot-restore")
        return self._pool
