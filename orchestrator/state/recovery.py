"""The recovery mode (`runtime.recovery`) as a strategy that the worker groups carry and the state plane calls:
the three things that differ between keeping survivors' processes and starting every process anew.

- `keep`: after a failure, a drain or a move, survivors off the `avoid` nodes keep the committed step: `InPlace`
  in their own processes (nothing moves; a rank that cannot prove it holds that step is replaced), `Restart` in
  their own node's keeper (tier live), handed over before their processes end.
- `holdings`: what a restore may read besides keepers and S3: the kept processes' memory (`InPlace`; the cheapest
  source of all), or nothing.
- `committed`: once every rank has committed a step after a restore, the copies kept for it go.

`InPlace.pool` holds the processes kept between groups (runtime/worker_group.WorkerPool on Ray,
state/fakes.LocalPool in one process). After nvidia-resiliency-ext's in-process restart, whose restart behaviour
is an injected strategy rather than flags through the call sites.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from typing import Any, Protocol

from orchestrator.state.keepers import KeeperSet, Received
from orchestrator.state.restore_plan import Holding, process_holdings
from planner import layout
from workers.transfer import KeptState, ProcessHolding, Receipt, Tier

log = logging.getLogger("hetspot.checkpoints")


class KeepingGroup(Protocol):
    """What the strategies ask of a worker group; state/protocols.StateGroup extends it (that module names this
    one's `Recovery`, so the strategies' part lives here)."""

    plan: Any  # the Plan the workers run
    holds_state: bool  # the workers hold the committed state (set by the state plane around restores)

    def retain(self, step: int | None, avoid: Set[str] = frozenset()) -> list[KeptState | None]: ...  # in place
    def held(self) -> list[ProcessHolding]: ...  # in place: the state kept in worker processes
    def drop_retained(self) -> None: ...  # in place: the kept copies are no longer needed
    def hand_over(self, keepers: list, timeout_s: float | None = None) -> list[Receipt | None]: ...


class InPlace:
    name = "in-place"

    def __init__(self, pool: Any):
        self.pool = pool

    def keep(self, group: KeepingGroup, keepers: KeeperSet, received: Received, avoid: Set[str],
             step: int | None) -> None:
        # even a group that failed before its restore: its processes still keep the step
        got = received.add(group.retain(step, avoid))
        kept = [g for g in got if g is not None]
        log.info("%d of %d workers keep their committed state (step %s) in their own processes", len(kept),
                 len(got), sorted({g.step for g in kept}))

    def holdings(self, group: KeepingGroup) -> tuple[list[Holding], dict[int, float]]:
        return process_holdings(group.held())

    def committed(self, group: KeepingGroup) -> None:
        group.drop_retained()


class Restart:
    name = "restart"
    pool = None

    def keep(self, group: KeepingGroup, keepers: KeeperSet, received: Received, avoid: Set[str],
             step: int | None) -> None:
        if not group.holds_state:
            return  # a group that failed before its state was restored holds nothing worth keeping
        ids = keepers.alive_nodes()
        keepers.call_all("clear", Tier.LIVE)
        ranks = layout.ranks(group.plan)
        keep = [r.node in ids and r.node not in avoid for r in ranks]
        alive = iter(keepers.on([r.node for r, k in zip(ranks, keep, strict=True) if k], ids))
        got = received.add(group.hand_over([next(alive) if k else None for k in keep]))
        kept = [g for g in got if g is not None]
        log.info("%d of %d workers handed their committed state (step %s) to their node's keeper", len(kept),
                 len(ranks), sorted({g.step for g in kept}))

    def holdings(self, group: KeepingGroup) -> tuple[list[Holding], dict[int, float]]:
        return [], {}

    def committed(self, group: KeepingGroup) -> None:
        return None


Recovery = InPlace | Restart


def take_kept(idle: list, wants: list[tuple[str, tuple[int, int]]]) -> list:
    """For each (node, extended layers `span`) a new group's ranks want, in rank order: the kept process in `idle`
    on that node that held the most of the span (ties: the lowest process id), taken out of `idle`; None when none
    is left there. One rule for every pool (runtime's WorkerPool, the fake's LocalPool): a rank reads in place as
    much of its new stage as it can. The pool is indexed by node once per group (a scan of the pool for each rank
    grew with the square of the ranks: 1.3 s of CPU at 10,752 ranks, bench/control_plane.py); `idle` keeps its
    order."""
    by_node: dict[str, list] = {}
    for k in idle:
        by_node.setdefault(k.node, []).append(k)
    out: list = []
    taken: set[int] = set()
    for node, span in wants:
        here = by_node.get(node)
        if not here:
            out.append(None)
            continue
        best = max(here, key=lambda k: (min(k.span[1], span[1]) - max(k.span[0], span[0]), -k.pid))
        here.remove(best)
        taken.add(id(best))
        out.append(best)
    if taken:
        idle[:] = [k for k in idle if id(k) not in taken]
    return out


def recovery(mode: str, pool: Any = None) -> Recovery:
    """The strategy for `runtime.recovery` ("in-place" keeps processes in `pool`; "restart")."""
    if mode == "in-place":
        return InPlace(pool)
    if mode == "restart":
        return Restart()
    raise ValueError(f"runtime.recovery {mode!r}: use in-place or restart")
