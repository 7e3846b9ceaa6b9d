"""`KeeperSet`: the job's node keepers as the state plane sees them: their lifecycle (started where state must go,
forgotten when their node goes), every call to all of them, their write checks, and their inventories as the
restore planner's holdings. Metadata only: what it takes in is counted (`Received`)."""

from __future__ import annotations

import logging
from typing import Any

from orchestrator.state.calls import StateCalls
from orchestrator.state.restore_plan import TIERS, Holding, keeper_holdings
from orchestrator.state.s3_store import S3Checkpoints
from workers.transfer import Tier, payload_bytes

log = logging.getLogger("hetspot.checkpoints")
RPC_TIMEOUT_S = 60.0  # a keeper's start, a salvage's hand-over, a drain snapshot: seconds to wait for keepers


class Received:
    """What the controller's side took in for state, in bytes: metadata only (tests and benches check it)."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, obj: Any) -> Any:
        self.bytes += payload_bytes(obj)
        return obj


class KeeperSet:
    def __init__(self, calls: StateCalls, s3: S3Checkpoints | None, received: Received):
        self.calls = calls  # how keepers are reached: Ray, or in one process (calls.LocalCalls)
        self.s3, self.received = s3, received
        self.keepers: dict[str, Any] = {}  # node -> its keeper's handle
        self.starting: dict[str, Any] = {}  # keepers started and not yet seen running
        self.no_access: dict[str, str] = {}  # nodes whose keeper cannot write the bucket: what S3 answered
        self.access: dict[str, Any] = {}  # keepers' write checks not yet answered

    def alive_nodes(self) -> dict[str, str]:
        return self.calls.alive_nodes()

    def on(self, nodes: list[str], ids: dict[str, str], wait: bool = True) -> list:
        """The keepers of `nodes` (alive, in `ids`), started together where missing; with `wait`, running before
        anyone sends them state. A keeper is a process (seconds to start): a group's first snapshot starts them."""
        for n in dict.fromkeys(nodes):
            if n not in self.keepers:
                k = self.calls.start_keeper(n, ids[n])
                self.keepers[n], self.starting[n] = k, k.ping.remote()
                if self.s3 is not None:  # checked as it starts, with its own node's credentials
                    self.access[n] = k.check_write.remote(self.s3.location)
        if wait:
            pending = [self.starting.pop(n) for n in dict.fromkeys(nodes) if n in self.starting]
            self.calls.get(pending, timeout=RPC_TIMEOUT_S)
        return [self.keepers[n] for n in nodes]

    def all_started(self) -> bool:
        """Every keeper started runs (never blocks)."""
        pending = list(self.starting.values())
        ready, _ = self.calls.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        return len(ready) == len(pending)

    def collect_access(self) -> None:
        """The keepers' write checks that have answered: a node that may not write the bucket is named as soon as
        its keeper started (its uploads would fail), not found out at the first upload. Never blocks."""
        if not self.access:
            return
        ready, _ = self.calls.wait(list(self.access.values()), num_returns=len(self.access), timeout=0)
        for node in [n for n, ref in self.access.items() if ref in ready]:
            try:
                err = self.calls.get(self.access.pop(node))
            except Exception:  # noqa: BLE001 - a keeper on a lost node
                continue
            if err is not None:
                self.no_access[node] = err
                log.warning("the keeper on %s cannot write %s (%s): that node's uploads will fail; give the node "
                            "credentials that may write the bucket (AWS: an instance profile)", node,
                            self.s3.uri if self.s3 else "the bucket", err)

    def call_all(self, method: str, *args: Any, timeout_s: float = 10.0) -> dict[str, Any]:
        """Call every keeper; those that do not answer (their node is gone) are forgotten."""
        refs = {node: getattr(k, method).remote(*args) for node, k in list(self.keepers.items())}
        ready, _ = self.calls.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        out = {}
        for node, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer in {timeout_s:.0f} s")
                out[node] = self.received.add(self.calls.get(ref))
            except Exception as e:  # a keeper on a lost node: what it held is gone
                log.info("keeper on %s is gone (%s); its state is not counted", node, type(e).__name__)
                self.keepers.pop(node, None), self.starting.pop(node, None)
        return out

    def unpin(self, step: int) -> None:
        """Let every keeper prune its peer copies of `step` again (an upload of it ended or was dropped)."""
        for k in list(self.keepers.values()):
            k.unpin.remote(step)

    def holdings(self, tiers: tuple[Tier, ...] = TIERS, step: int | None = None,
                 ) -> tuple[list[Holding], dict[int, float], dict[str, list[int]]]:
        """The keepers' holdings, as the restore planner's Holdings; optimizer steps by step, unit shapes."""
        return keeper_holdings(self.call_all("inventory"), tiers, step)
