"""Fakes of the controller's protocols, shipped with the package (as torchft ships its dummies).

Unit tests and examples step the controller with them: no Ray, no clock waits.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from orchestrator.control.protocols import JobCard, Notice, YieldRequest
from orchestrator.errors import WorkerFailure
from planner import ClusterSpec, Plan


class FakeNodes:
    """Returns the given clusters in turn, then keeps returning the last one."""

    def __init__(self, *clusters: ClusterSpec):
        self.clusters = list(clusters)
        self.calls = 0
        self.notes: dict[str, str] = {}
        self.held: dict[str, dict[str, int]] = {}

    def discover(self) -> ClusterSpec:
        c = self.clusters[min(self.calls, len(self.clusters) - 1)]
        self.calls += 1
        return c

    def whole(self) -> ClusterSpec:  # one job: every GPU discovered is free to it
        return self.clusters[min(max(self.calls - 1, 0), len(self.clusters) - 1)]


class MemoryQueue:
    """One job's place in a queue shared by the fakes of several jobs in one process: `line`, the waiting jobs in
    the order they came; `board`, every job's priority ("priority"), the cards of those that share the fleet by
    weighted throughput ("cards") and the requests to give GPUs back ("asks")."""

    def __init__(self, job: str, line: list[str], priority: int = 0, board: dict | None = None,
                 card: JobCard | None = None):
        self.job, self.line, self.priority, self.card = job, line, priority, card
        self.board = board if board is not None else {}
        for key in ("priority", "asks", "cards"):
            self.board.setdefault(key, {})

    def _show(self) -> None:
        self.board["priority"][self.job] = self.priority
        if self.card is not None:
            self.board["cards"][self.job] = self.card

    def enter(self) -> None:
        self._show()
        if self.job not in self.line:
            self.line.append(self.job)

    def ahead(self) -> list[str]:
        prio = self.board["priority"]
        order = sorted(self.line, key=lambda j: (-prio.get(j, 0), self.line.index(j)))
        return order[:order.index(self.job)] if self.job in order else order

    def hold(self) -> None:
        self._show()
        if self.job in self.line:
            self.line.remove(self.job)

    def leave(self) -> None:
        self.board["priority"].pop(self.job, None)
        self.board["cards"].pop(self.job, None)
        if self.job in self.line:
            self.line.remove(self.job)

    def priorities(self) -> dict[str, int]:
        return dict(self.board["priority"])

    def ask(self, job: str, nodes: list[str], share: bool = False) -> None:
        self.board["asks"][job] = YieldRequest(self.job, self.priority, sorted(nodes), share)

    def sharing(self) -> dict[str, JobCard]:
        return dict(self.board["cards"])

    def asked(self) -> YieldRequest | None:
        return self.board["asks"].pop(self.job, None)


class FakeWorkerGroup:
    """A worker group whose loss at step s is a pure function of the applied-step counter.

    `fail_at`: steps at which `step` raises a WorkerFailure of `fail_kind` (each once);
    `fail_start`: `start` raises. `log` records starts, imports and shutdowns.
    """

    def __init__(self, plan: Plan, log: list, fail_at: list[int] | None = None, fail_start: bool = False,
                 fail_kind: str = "node lost", stages_switch: bool = False, ready_after: int = 0):
        self.plan, self.log, self.fail_at, self.fail_start = plan, log, fail_at, fail_start
        self.fail_kind = fail_kind
        self.stages_switch, self.ready_after = stages_switch, ready_after  # a notice's switch is pre-staged
        self.applied = 0
        self.last_peak_mem = 0

    def start(self) -> None:
        self.log.append(("start", len(self.plan.devices())))
        if self.fail_start:
            raise WorkerFailure("rank 0 (pipeline 0, stage 0, T4 on t)", "actor died during start-up", "actor died")

    def step(self, s: int) -> float:
        if self.fail_at and s == self.fail_at[0]:
            self.fail_at.pop(0)
            raise WorkerFailure("rank 1 (pipeline 0, stage 0, A100-80GB on a)", self.fail_kind, self.fail_kind)
        assert s == self.applied, "steps must run in order with no gap or repeat"
        self.applied += 1
        return 10.0 - s

    def evaluate(self, batches: int) -> float:
        """A validation loss that is a pure function of the applied steps, as the training loss is."""
        return 20.0 - self.applied

    def export_state(self) -> tuple[dict, float]:
        return {"applied": self.applied}, float(self.applied)

    def import_state(self, state: Any, steps: float) -> None:
        self.applied = state["applied"]
        self.log.append(("import", state["applied"]))

    def release(self) -> None:
        self.shutdown()

    def prestage(self, plan: Plan) -> int:  # its warm workers are ready after `ready_after` looks
        self.log.append(("prestage", len(plan.devices())))
        return self.ready_after

    def staged_ready(self) -> bool:
        self.ready_after -= 1
        return self.ready_after < 0

    def warm_joined(self, cluster: ClusterSpec, nodes: Set[str]) -> int:  # ready after `ready_after` looks
        self.log.append(("warm-joined", sorted(nodes)))
        return sum(n.num_gpus for n in cluster.nodes if n.name in nodes)

    def warm_spares(self, cluster: ClusterSpec) -> int:
        return 0

    def give_up(self, nodes: Set[str]) -> int:
        self.log.append(("give-up", sorted(nodes)))
        return 0

    def shutdown(self) -> None:
        self.log.append(("shutdown",))


class FakeClock:
    """A clock that moves only when told (`advance`), or by `tick` per reading."""

    def __init__(self, start: float = 0.0, tick: float = 0.0):
        self.t, self.tick = start, tick

    def now(self) -> float:
        self.t += self.tick
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeInterruptions:
    """Notices scripted by poll number: {k: [Notice, ...]} arrive on the k-th poll (0-based).

    The controller polls once at each step boundary, so in a run without failures
    poll k happens just before step k.
    """

    def __init__(self, by_poll: dict[int, list[Notice]] | None = None):
        self.by_poll = dict(by_poll or {})
        self.polls = 0

    def poll(self) -> list[Notice]:
        got = self.by_poll.pop(self.polls, [])
        self.polls += 1
        return got
