"""`RayNotices`: the controller's InterruptionSource on a Ray cluster.

Two kinds of notice, both turned into `Notice(node, deadline_s, source)` on the
controller's clock:
  - cloud spot notices: one small `NoticePoller` actor per GPU node, pinned to
    that node, polls the node's own metadata service on a thread every
    `interval_s` (orchestrator/preemption/notices.py). The service's base URL
    is the cloud's, or the node's `hetspot/metadata-url` label (the fake
    metadata server of tests and drills);
  - Ray's own drain: a node that Ray marks as draining (the autoscaler,
    KubeRay, or `ray drain-node --deadline-remaining-seconds N`) with its
    deadline, read from the GCS.
`poll()` returns each node's notice once. A capacity reclaim takes several
instances within seconds, while each poller reads its own node on its own
phase: when one node's notice arrives, `poll()` has every other node's poller
read its metadata service again at once (`NoticePoller.check`), so notices
given together are heeded together (one drain, one re-plan) rather than one
step boundary apart.
"""

from __future__ import annotations

import logging
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchestrator.control.protocols import Clock, Notice, SystemClock

LABEL_METADATA_URL = "hetspot/metadata-url"
DRAIN_DEFAULT_S = 120.0  # a drain without a deadline: assume a spot notice's two minutes
log = logging.getLogger("hetspot.notices")


@ray.remote(num_cpus=0, max_restarts=0)
class NoticePoller:
    def __init__(self, cloud: str, base_url: str | None, interval_s: float):
        from orchestrator.preemption.notices import poll

        self.notice = None
        self.stopped = threading.Event()
        self._poll = lambda: poll(cloud, base_url, timeout_s=min(1.0, interval_s))

        def loop() -> None:
            while not self.stopped.is_set() and self.notice is None:
                self.notice = self.notice or self._poll()
                self.stopped.wait(interval_s)

        threading.Thread(target=loop, daemon=True, name="hetspot-notice-poller").start()

    def take(self):
        """The notice seen so far (source, deadline as UNIX time), or None."""
        return None if self.notice is None else (self.notice.source, self.notice.deadline_unix)

    def check(self):
        """`take`, after reading the node's metadata service now when no notice is seen yet."""
        if self.notice is None:
            self.notice = self._poll()
        return self.take()


class RayNotices:
    def __init__(self, cloud: str | None, interval_s: float = 1.0, clock: Clock | None = None,
                 grace_s: float | None = None):
        self.cloud, self.interval_s = cloud, interval_s
        self.grace_s = grace_s  # a GCP notice carries no deadline: the platform's grace (GKE spot pods: 15 s)
        self.clock = clock or SystemClock()
        self.pollers: dict[str, object] = {}
        self.reported: set[str] = set()

    def _nodes(self) -> dict[str, dict]:
        """Alive GPU nodes by discovery name: Ray node id and labels."""
        from orchestrator.cluster.discovery import RayInventory

        raw = ray.nodes()  # once per step boundary: discovery reads the same list
        labels = {n["NodeID"]: n.get("Labels") or {} for n in raw if n.get("Alive")}
        return {d.name: {"node_id": d.node_id, "labels": labels.get(d.node_id, {})}
                for d in RayInventory().discover(raw)}

    def _watch(self, nodes: dict[str, dict]) -> None:
        for name, n in nodes.items():
            if name in self.pollers or not self.cloud:
                continue
            self.pollers[name] = NoticePoller.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["node_id"], soft=False),
                name=None).remote(self.cloud, n["labels"].get(LABEL_METADATA_URL), self.interval_s)

    def _to_notice(self, node: str, source: str, deadline_unix: float) -> Notice:
        if source == "gcp" and self.grace_s is not None:  # the poller assumed a VM's 30 s from when it read it
            from orchestrator.preemption.notices import GCP_NOTICE_S

            deadline_unix += self.grace_s - GCP_NOTICE_S
        return Notice(node=node, deadline_s=self.clock.now() + (deadline_unix - time.time()), source=source)

    def _read(self, names: list[str], method: str) -> list[Notice]:
        """The notices the pollers on `names` hold (`take`) or read now (`check`)."""
        out, refs = [], {n: getattr(self.pollers[n], method).remote() for n in names}
        for name, ref in refs.items():
            try:
                got = ray.get(ref, timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                # the node went before its notice was read: the loss reaches the controller as a failure
                log.info("notice poller on %s is gone (%s)", name, type(e).__name__)
                self.pollers.pop(name, None)
                continue
            if got is not None:
                out.append(self._to_notice(name, *got))
        return out

    def poll(self) -> list[Notice]:
        nodes = self._nodes()
        self._watch(nodes)
        names = [n for n in self.pollers if n in nodes and n not in self.reported]
        out = self._read(names, "take")
        if out:  # one notice: the others of the same reclaim may be up on their nodes, not yet read by their pollers
            out += self._read([n for n in names if n in self.pollers and n not in {m.node for m in out}], "check")
        by_id = {n["node_id"]: name for name, n in nodes.items()}
        draining = ray._private.state.state.get_draining_nodes()  # {node id: deadline in ms, 0 = none}
        for node_id, deadline_ms in draining.items():
            name = by_id.get(node_id if isinstance(node_id, str) else node_id.hex())
            if name and name not in self.reported and name not in {n.node for n in out}:
                deadline = deadline_ms / 1000 if deadline_ms else time.time() + DRAIN_DEFAULT_S
                out.append(self._to_notice(name, "ray-drain", deadline))
        for n in out:
            self.reported.add(n.node)
            log.warning("notice: node %s will be taken (%s) in %.1f s", n.node, n.source,
                        n.deadline_s - self.clock.now())
        return out

    def close(self) -> None:
        for a in self.pollers.values():
            ray.kill(a)
        self.pollers = {}
