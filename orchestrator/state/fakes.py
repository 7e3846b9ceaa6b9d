"""`LocalGroup`: the worker side of the state plane's calls, in one process over numpy shards (the shipped fake).

Beside `calls.LocalCalls` it lets `TieredState` (tiers.py) snapshot, upload, salvage and restore in unit tests
without a Ray cluster, on both recovery paths: handing survivors' state to keepers (restart), or keeping it in the
worker processes themselves (in place: `LocalGroup(..., InPlace(LocalPool()))`, whose `retain`, `held`,
`drop_retained` and `release` stand for runtime/worker_group.RayWorkerGroup's, and whose pool runs the same
state/processes.Pool logic as runtime/processes.WorkerPool). Each rank of the plan holds its
slice of every unit of its stage: one unit per extended layer (`unit_name`), split along its first dimension among
a stage's TP ranks, whose values are a function of the committed step (`values`), so a test checks that a restore
brought back exactly the step it says, from whichever sources it chose, under any TP layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Set
from typing import Any

import numpy as np

from orchestrator.state.calls import LocalCalls
from orchestrator.state.processes import Pool
from orchestrator.state.recovery import Recovery, Restart
from planner import Plan, layout
from workers.restore import Kept
from workers.shards import KEYS, shard_nbytes
from workers.transfer import (
    CheckpointLocation,
    Fetch,
    HeldRow,
    KeptState,
    LoadReport,
    NeedRow,
    Piece,
    PieceRequest,
    ProcessHolding,
    Receipt,
    Refused,
    Region,
    Tier,
)

SHAPE = (4, 3)  # every unit's full shape; TP ranks split the first dimension (TP 1, 2 or 4)
_pids = itertools.count(1000)


def unit_name(layer: int) -> str:
    return f"layer{layer}"


def values(step: int, unit: str) -> dict[str, np.ndarray]:
    """A unit's committed tensors at `step`: distinct per step, unit and element."""
    base = float(step * 100 + sum(map(ord, unit)))
    p = base + np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE) / 100
    return {"param": p, "exp_avg": p + 0.5, "exp_avg_sq": p + 0.25}


def model_units(num_layers: int) -> dict[str, list[int]]:
    return {unit_name(x): list(SHAPE) for x in range(-1, num_layers + 1)}


def tp_region(tp_rank: int, tp: int) -> Region:
    """The slice of a unit a TP rank holds: its share of the first dimension, all of the others."""
    if SHAPE[0] % tp:
        raise ValueError(f"LocalGroup splits units of {SHAPE} among TP ranks: TP {tp} does not divide {SHAPE[0]}")
    n = SHAPE[0] // tp
    return ((tp_rank * n, (tp_rank + 1) * n),) + tuple((0, d) for d in SHAPE[1:])


def _cut(full: dict[str, np.ndarray], region: Region) -> dict[str, np.ndarray]:
    idx = tuple(slice(a, b) for a, b in region)
    return {k: v[idx].copy() for k, v in full.items()}


def _shard(tensors: dict, region: Region, step: int) -> dict:
    return tensors | {"slice": region, "shape": SHAPE, "optimizer_steps": float(step + 1)}


class LocalProcess:
    """One worker process of a `LocalGroup`. In place it outlives its group and keeps a committed step's shards
    (`retain`), which it serves as a kept TrainWorker does (`get_many`)."""

    def __init__(self, node: str, warm: bool = False):
        self.node, self.pid = node, next(_pids)
        self.span: tuple[int, int] = (0, 0)  # the extended layers its last stage held
        self.kept = Kept()  # what a kept TrainWorker keeps (workers/restore.py), served the same way
        self.warm = warm  # started ahead of need (state/processes.Pool.warm_up), until a rank takes it
        self.ended = False

    @property
    def step(self) -> int:
        return self.retained[0] if self.retained is not None else -1

    def end(self) -> None:
        self.ended, self.retained = True, None

    @property
    def retained(self) -> tuple[int, dict] | None:  # (step, shards) kept for the next plan
        return self.kept.state

    @retained.setter
    def retained(self, v: tuple[int, dict] | None) -> None:
        self.kept.state = v

    def get_many(self, requests: list[PieceRequest], step: int, s3: CheckpointLocation | None = None,
                 keys: tuple[str, ...] | None = None) -> list[Piece | Refused]:
        return self.serve(requests, step, keys, Tier.LIVE)

    def serve(self, requests: list[PieceRequest], step: int, keys: tuple[str, ...] | None,
              tier: Tier) -> list[Piece | Refused]:
        return self.kept.answer(requests, step, keys, tier)

    def held(self) -> list[HeldRow]:
        return self.kept.rows()


class LocalPool(Pool[LocalProcess]):
    """Processes kept between a `LocalGroup` and the next, and warm workers: state/processes.Pool, whose logic
    runtime/processes.WorkerPool runs on Ray, over `LocalProcess`es. Warm workers start on `nodes` (None: any)
    and are ready at once."""

    def __init__(self, nodes: list[str] | None = None) -> None:
        super().__init__()
        self.nodes = nodes

    def _alive(self, nodes: Set[str]) -> Mapping[str, Any]:
        return {n: None for n in nodes if self.nodes is None or n in self.nodes}

    def _start(self, node: str, info: Any) -> LocalProcess:
        return LocalProcess(node, warm=True)

    def warm_ready(self) -> bool:
        return True


class LocalGroup:
    """A plan's workers: `commit(step)` gives every rank its units' values at `step`; the state plane's calls
    (`snapshot`, `hand_over`, `needs`, `load`, `settle_restore`; in place `retain`, `held`, `drop_retained`) go to
    keepers and kept processes through `calls`. `recovery` (default restart) is the job's strategy: in place its
    ranks take its pool's kept processes on their nodes, and `release` leaves the ones `retain` kept there."""

    def __init__(self, plan: Plan, calls: LocalCalls, recovery: Recovery | None = None) -> None:
        self.plan, self.calls = plan, calls
        self.recovery: Recovery = recovery or Restart()
        self.processes = self.recovery.processes
        self.stages_switch = self.recovery.stages_switch
        self.ranks = layout.ranks(plan)
        spans = layout.rank_spans(plan)
        self.units = [[unit_name(x) for x in range(a, b)] for _, a, b in spans]
        tps = [plan.pipelines[r.pipeline].stages[r.stage].tp for r in self.ranks]
        self.regions = [tp_region(r.tp_rank, tp) for r, tp in zip(self.ranks, tps, strict=True)]
        self.procs: list[LocalProcess] = []
        self.kept: list[bool] = []  # per rank: its process was kept from an earlier group
        wants = [(r.node, (a, b)) for r, (_, a, b) in zip(self.ranks, spans, strict=True)]
        taken = self.processes.take(wants)
        for r, (_, a, b), p in zip(self.ranks, spans, taken, strict=True):
            self.kept.append(p is not None)
            self.procs.append(p or LocalProcess(r.node))
            self.procs[-1].span, self.procs[-1].warm = (a, b), False
        self.step: int | None = None
        self.shards: list[dict] = [{} for _ in self.ranks]
        self.holds_state = False
        self.retained: list[KeptState | None] | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def commit(self, step: int) -> None:
        self.step, self.holds_state = step, True
        self.shards = [{u: _shard(_cut(values(step, u), reg), reg, step) for u in units}
                       for units, reg in zip(self.units, self.regions, strict=True)]

    def _alive(self, rank: int) -> bool:
        return self.ranks[rank].node not in self.calls.dead

    def snapshot(self, step: int, keepers: list, pin: bool = False) -> list:
        assert step == self.step
        return [k.put.remote(Tier.PEER, step, i, self.shards[i], pin) if self._alive(i) else
                self.calls.handle(self, self.ranks[i].node).gone.remote() for i, k in enumerate(keepers)]

    def hand_over(self, keepers: list, timeout_s: float | None = None) -> list[Receipt | None]:
        return [self.calls.get(k.put.remote(Tier.LIVE, self.step, i, self.shards[i])) if k is not None else None
                for i, k in enumerate(keepers)]

    def needs(self) -> list[list[NeedRow]]:
        out = []
        for units, reg in zip(self.units, self.regions, strict=True):
            nbytes = shard_nbytes(_cut(values(0, "x"), reg))
            out.append([NeedRow(u, reg, nbytes) for u in units])
        return out

    def load(self, per_rank: list[list[Fetch]], step: int, optimizer_steps: float, s3: CheckpointLocation | None,
             overlap: bool = True) -> list[LoadReport]:
        out, shards = [], []
        for i, fetches in enumerate(per_rank):
            mine = self.regions[i]
            got: dict[str, dict] = {}
            by_tier: dict[Tier, int] = {}
            for f in fetches:
                if f.source is None:  # this rank's own process kept it: read in place
                    (a,) = self.procs[i].serve([f.request], step, None, Tier.IN_PLACE)
                else:
                    (a,) = self.calls.get(f.source.get_many.remote([f.request], step, s3))
                if isinstance(a, Refused):
                    return [LoadReport(refused=a)]
                local = got.setdefault(f.unit, {k: np.zeros([b - c for c, b in mine]) for k in KEYS})
                idx = tuple(slice(a0 - m0, b0 - m0) for (a0, b0), (m0, _) in zip(f.region, mine, strict=True))
                for k, v in a.tensors.items():
                    if v is not None:
                        local[k][idx] = v
                by_tier[a.tier] = by_tier.get(a.tier, 0) + a.bytes
            shards.append({u: _shard(t, mine, step) for u, t in got.items()})
            out.append(LoadReport(by_tier))
        self.shards, self.step, self.holds_state = shards, step, True
        return out

    def settle_restore(self, timeout_s: float | None = None) -> None:
        return None

    # -- in place --
    def retain(self, step: int | None, avoid: Set[str] = frozenset()) -> list[KeptState | None]:
        """Each rank alive and off `avoid` whose committed step is `step` (None: any) keeps it in its process."""
        out: list[KeptState | None] = []
        for i, p in enumerate(self.procs):
            if not self._alive(i) or p.node in avoid:
                p.retained = None
            elif self.holds_state and self.step is not None and step in (None, self.step):
                p.retained = (self.step, self.shards[i])
            elif not (p.retained is not None and step in (None, p.retained[0])):  # kept from before its restore
                p.retained = None
            out.append(None if p.retained is None else KeptState(p.retained[0], p.pid, sum(
                shard_nbytes(sh) for sh in p.retained[1].values())))
        self.retained = out
        return out

    def held(self) -> list[ProcessHolding]:
        """The kept processes' state: this group's ranks that took one (their rank), then the pool's idle ones."""
        procs: list[tuple[int | None, LocalProcess]] = [
            (i, p) for i, p in enumerate(self.procs) if self.kept[i] and p.retained is not None]
        procs += [(None, p) for p in self.processes.holding()]
        return [ProcessHolding(i, p.node, self.calls.handle(p, p.node), tuple(p.held())) for i, p in procs]

    def drop_retained(self) -> None:
        for p, kept in zip(self.procs, self.kept, strict=True):
            if kept:
                p.retained = None

    def release(self) -> None:
        """End this group; the processes that `retain` kept go to the strategy's processes for the next group."""
        retained = self.retained or [None] * len(self.procs)
        for p, k in zip(self.procs, retained, strict=True):
            if k is None:
                p.end()
        self.processes.keep([p for p, k in zip(self.procs, retained, strict=True) if k is not None])

    def shutdown(self) -> None:
        for p in self.procs:
            p.end()
        self.processes.end_all()

    def gone(self) -> None:  # a call to a rank whose node is gone (LocalHandle raises NodeGone first)
        return None
