"""Worker processes that outlive their group: the `Processes` protocol and the one pool logic both sides run.

A pool holds two kinds of process between plans (AutoHet's local-first recovery taken to the process):
- kept (`idle`): survivors of a failure, a drain or a move, each keeping its committed step in memory; the next
  plan's ranks take the one on their node that held the most of their layers, and the ones no rank takes serve
  their state to the restore and end once every rank has committed a step (`end_idle`);
- warm (`warm`): processes started ahead of need (a notice's pre-staged switch, a join, `runtime.warm_workers`),
  holding no state, whose imports and device context are ready when a rank takes one.

`Pool` is the logic, written once: which process a rank takes, how many warm workers each node still needs, which
warm workers a changed cluster ends. Its two subclasses add only how a process starts and whether it has:
runtime/processes.WorkerPool (TrainWorker actors, one GPU placement group each) and state/fakes.LocalPool (one
process, no Ray). The recovery strategy (state/recovery.py) decides whether a job has a pool at all.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Set
from typing import Any, Generic, Protocol, TypeVar

log = logging.getLogger("hetspot.runner")

Wants = list[tuple[str, tuple[int, int]]]  # per rank of a new group: (its node, the extended layers it holds)


class Process(Protocol):
    """A process a pool holds (runtime/processes.Kept; state/fakes.LocalProcess)."""

    node: str
    span: tuple[int, int]  # the extended layers its last stage held
    pid: int

    @property
    def step(self) -> int: ...  # the committed step it keeps in memory (-1: none)

    @property
    def warm(self) -> bool: ...  # started ahead of need: it never held a rank

    def end(self) -> None: ...  # the process ends (its GPU is given back)


P = TypeVar("P", bound=Process)


class Processes(Protocol):
    """What a worker group asks of the processes that outlive it. The recovery strategy carries one: a `Pool`
    (in place) or `NoProcesses` (restart, whose versions do nothing)."""

    def take(self, wants: Wants) -> list[Any]: ...  # per rank: a kept or warm process on its node, or None
    def give_back(self, procs: list[Any]) -> None: ...  # processes taken for ranks a failed start never reached
    def keep(self, procs: list[Any]) -> None: ...  # a group's survivors, each keeping its step, for the next group
    def holding(self) -> list[Any]: ...  # the kept processes no rank took that hold a committed step
    def end_idle(self) -> None: ...  # every rank committed a step: the kept processes no rank took end
    def warm_up(self, want: Counter[str], most: int, busy: Counter[str]) -> int: ...  # warm workers so that each
    # node has `want[node]` processes of the job (`busy`: the group's ranks), at most `most` started; how many
    def spares(self, gpus: Counter[str], count: int, busy: Counter[str]) -> int: ...  # standing warm workers
    def warm_ready(self) -> bool: ...  # every warm worker has started
    def end_warm(self, nodes: Set[str]) -> int: ...  # the warm workers on `nodes` end; how many
    def give_up(self, nodes: Set[str]) -> int: ...  # warm workers and kept processes no rank took on `nodes` end
    def end_all(self) -> None: ...


def take_kept(idle: list[P], wants: Wants) -> list[P | None]:
    """For each (node, extended layers `span`) a new group's ranks want, in rank order: the kept process in `idle`
    on that node that held the most of the span (ties: the lowest process id), taken out of `idle`; None when none
    is left there. A rank reads in place as much of its new stage as it can. The pool is indexed by node once per
    group (a scan of the pool for each rank grew with the square of the ranks: 1.3 s of CPU at 10,752 ranks,
    bench/control_plane.py); `idle` keeps its order."""
    by_node: dict[str, list[P]] = {}
    for k in idle:
        by_node.setdefault(k.node, []).append(k)
    out: list[P | None] = []
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


class Pool(Generic[P]):
    """The processes kept between plans and the warm workers, as lists; subclasses say how a warm worker starts
    (`_start`), on which nodes one can (`_alive`), and whether all have started (`warm_ready`)."""

    def __init__(self) -> None:
        self.idle: list[P] = []  # kept processes, each with its committed step (or none: -1)
        self.warm: list[P] = []  # warm workers: processes started ahead of need, holding no state

    # -- what a subclass provides --
    def _alive(self, nodes: Set[str]) -> Mapping[str, Any]:
        """Of `nodes`, the ones a warm worker can start on now, each with what `_start` needs to know of it."""
        raise NotImplementedError

    def _start(self, node: str, info: Any) -> P:
        raise NotImplementedError

    def warm_ready(self) -> bool:
        raise NotImplementedError

    # -- the logic, once --
    def take(self, wants: Wants) -> list[P | None]:
        """Per (node, span) a new group's ranks want, in rank order: the kept process on the node that held the
        most of the span (`take_kept`), else a warm worker there, else None."""
        out = take_kept(self.idle, wants)
        warm: dict[str, list[P]] = {}
        for k in self.warm:
            warm.setdefault(k.node, []).append(k)
        for i, (node, _) in enumerate(wants):
            if out[i] is None and warm.get(node):
                out[i] = warm[node].pop(0)
        taken = {id(k) for k in out if k is not None}
        self.warm = [k for k in self.warm if id(k) not in taken]
        return out

    def give_back(self, procs: list[P]) -> None:
        self.warm += [k for k in procs if k.warm]
        self.idle += [k for k in procs if not k.warm]

    def keep(self, procs: list[P]) -> None:
        self.idle += procs

    def holding(self) -> list[P]:
        return [k for k in self.idle if k.step >= 0]

    def end_idle(self) -> None:
        for k in self.idle:
            k.end()
        self.idle = []

    def warm_up(self, want: Counter[str], most: int, busy: Counter[str]) -> int:
        # runtime.warm_workers: 0 (the default), or as many as asked already wait: no cluster query
        if most <= 0:
            return 0
        alive = self._alive({n for n, k in want.items() if k > 0})
        have = busy + Counter(k.node for k in self.idle + self.warm)
        started = 0
        for node, n in sorted(want.items()):
            for _ in range(n - have[node]):
                if started >= most or node not in alive:
                    break
                self.warm.append(self._start(node, alive[node]))
                started += 1
        if started:
            log.info("started %d warm worker(s) on %s", started, ", ".join(sorted({k.node for k in self.warm})))
        return started

    def spares(self, gpus: Counter[str], count: int, busy: Counter[str]) -> int:
        """Standing warm workers (runtime.warm_workers): `count` of them on the GPUs of `gpus` (node -> GPUs) that
        the group's ranks and kept processes leave idle; warm workers on nodes not in `gpus` end first."""
        self.end_warm({k.node for k in self.warm} - set(gpus))
        return self.warm_up(gpus, count - len(self.warm), busy)

    def end_warm(self, nodes: Set[str]) -> int:
        ending = [k for k in self.warm if k.node in nodes]
        for k in ending:
            k.end()
        self.warm = [k for k in self.warm if k.node not in nodes]
        return len(ending)

    def give_up(self, nodes: Set[str]) -> int:
        """Another job asked for the GPUs on `nodes`, which no rank of the group uses: the warm workers there and
        the kept processes no rank took end (a restore before the next commit reads their step from the keepers
        or S3 instead); how many."""
        idle = [k for k in self.idle if k.node in nodes]
        for k in idle:
            k.end()
        self.idle = [k for k in self.idle if k.node not in nodes]
        return len(idle) + self.end_warm(nodes)

    def end_all(self) -> None:
        self.end_idle()
        self.end_warm({k.node for k in self.warm})
