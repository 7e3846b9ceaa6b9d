"""The recovery mode (`runtime.recovery`) as a strategy that the worker groups carry and the state plane calls:
the three things that differ between keeping survivors' processes and starting every process anew.

- `keep`: after a failure, a drain or a move, survivors off the `avoid` nodes keep the committed step: `InPlace`
  in their own processes (nothing moves; a rank that cannot prove it holds that step is replaced), `Restart` in
  their own node's keeper (tier live), handed over before their processes end.
- `holdings`: what a restore may read besides keepers and S3: the kept processes' memory (`InPlace`; the cheapest
  source of all), or nothing.
- `committed`: once every rank has committed a step after a restore, the copies kept for it go, and so do the
  kept processes no rank took.
- `processes`: the processes that outlive a group (state/processes.Processes: take, keep, end idle, warm, warm
  ready): `InPlace`'s pool (runtime/processes.WorkerPool on Ray, state/fakes.LocalPool in one process), or
  `NoProcesses`, whose versions do nothing (restart: every process ends with its group).
- `keeps_processes`: survivors' processes outlive their group, to be taken by the next one (what the fleet
  simulator's cost model charges by: drills/recovery_model.py).
- `stages_switch`: a notice's switch is pre-staged (the next plan chosen, its new ranks' warm workers started while
  the doomed nodes still train) only where processes outlive their group to be taken.

A worker group, the state plane, the controller's staging and the fleet simulator read these and nothing else: no
code outside this module asks which mode runs (`strategy_kind` turns a mode's name into its strategy). After
nvidia-resiliency-ext's in-process restart, whose restart behaviour is an injected strategy rather than flags
through the call sites.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Set
from typing import Any, Protocol

from orchestrator.state.keepers import KeeperSet, Received
from orchestrator.state.processes import Processes, Wants
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
    def drop_retained(self) -> None: ...  # in place: the copies the group's ranks kept are no longer needed
    def hand_over(self, keepers: list, timeout_s: float | None = None) -> list[Receipt | None]: ...


class NoProcesses:
    """Restart's processes: none outlives its group, so none is taken, kept or warmed."""

    def take(self, wants: Wants) -> list[Any]:
        return [None] * len(wants)

    def give_back(self, procs: list[Any]) -> None:
        for k in procs:
            k.end()

    def keep(self, procs: list[Any]) -> None:
        self.give_back(procs)

    def holding(self) -> list[Any]:
        return []

    def end_idle(self) -> None:
        return None

    def warm_up(self, want: Counter[str], most: int, busy: Counter[str]) -> int:
        return 0

    def spares(self, gpus: Counter[str], count: int, busy: Counter[str]) -> int:
        return 0

    def warm_ready(self) -> bool:
        return True

    def end_warm(self, nodes: Set[str]) -> int:
        return 0

    def give_up(self, nodes: Set[str]) -> int:
        return 0

    def end_all(self) -> None:
        return None


class InPlace:
    name = "in-place"
    keeps_processes = True
    stages_switch = True

    def __init__(self, pool: Processes):
        self.processes: Processes = pool

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
        self.processes.end_idle()


class Restart:
    name = "restart"
    keeps_processes = False
    stages_switch = False

    def __init__(self) -> None:
        self.processes: Processes = NoProcesses()

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


STRATEGIES: dict[str, type[InPlace] | type[Restart]] = {InPlace.name: InPlace, Restart.name: Restart}


def strategy_kind(mode: str) -> type[InPlace] | type[Restart]:
    """The strategy `runtime.recovery` names; a name that is none says which are."""
    try:
        return STRATEGIES[mode]
    except KeyError:
        raise ValueError(f"runtime.recovery {mode!r}: use {' or '.join(STRATEGIES)}") from None


def recovery(mode: str, pool: Processes | None = None) -> Recovery:
    """The strategy for `runtime.recovery`, its processes kept in `pool` where it keeps processes."""
    kind = strategy_kind(mode)
    if kind is Restart:
        return Restart()
    if pool is None:
        raise ValueError(f"runtime.recovery {mode} keeps processes in a pool: pass one")
    return InPlace(pool)
