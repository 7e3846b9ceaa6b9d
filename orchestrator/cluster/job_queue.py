"""The queue of hetspot jobs on one Ray cluster that wait for GPUs other jobs hold.

A job whose minimum (the smallest plan that trains) does not fit on the GPUs free to it waits in the controller's
`queued` state instead of failing. The queue orders the waiting jobs first come, first served: each keeps an entry
under its job id in the GCS's key-value store (namespace `hetspot-queue`), with the time it first entered and its
Ray job; only the first job in line takes GPUs that come free, so a job that waits longer is never overtaken by
one that came later. An entry whose Ray job is dead (a driver killed before its controller left the queue) is
dropped by whoever reads it next, as the autoscaler demand's entries are (cluster/job_entries.py).

A job that can train on what is free does not look at the queue: the queue orders only jobs that cannot.
Priorities (`runtime.priority`): waiting jobs go by priority first, then first come. A running job keeps its
entry (no `since`), so its priority is seen: the first job in line asks running jobs of lower priority for their
GPUs on some nodes with a request under the running job's id (namespace `hetspot-yield`), which that job reads
at its next step boundary. A job that shares the fleet by weighted throughput (`runtime.fleet_share: weighted`)
shows its card in its entry (its priority, model and training: control/protocols.JobCard), so that every job
that shares can rate the others on any set of nodes (control/share.py); the first in line asks the jobs whose
GPUs that share gives it, whatever their priority.
"""

from __future__ import annotations

import json
import time

from orchestrator.control.protocols import JobCard, YieldRequest
from planner.specs import ModelSpec, TrainSpec

NAMESPACE = "hetspot-queue"
ASKS = "hetspot-yield"  # a waiting job's request to a running job of lower priority, under the running job's id


def entries() -> dict[str, dict]:
    """job id -> its entry (`since`: when it first waited, None once it runs; `priority`) of every live job."""
    from orchestrator.cluster.job_entries import live_entries

    return live_entries(NAMESPACE, "place in the queue")


def waiting() -> list[tuple[str, float]]:
    """(job id, UNIX time it entered) of every job waiting on the connected cluster, in the order they go: higher
    priority first, then first come; the entries of jobs whose Ray job is dead are deleted."""
    line = [(job, float(e["since"]), int(e.get("priority", 0))) for job, e in entries().items()
            if e.get("since") is not None]
    return [(job, since) for job, since, _ in sorted(line, key=lambda e: (-e[2], e[1], e[0]))]


class RayJobQueue:
    """One job's place in its cluster's queue (control/protocols.JobQueue)."""

    def __init__(self, job_id: str, priority: int = 0, card: JobCard | None = None):
        self.job_id, self.priority, self.card = job_id, priority, card
        self.job = job_id
        self.since: float | None = None
        self._entered = False

    def _put(self) -> None:
        import ray
        from ray.experimental.internal_kv import _internal_kv_put

        entry = {"since": self.since, "priority": self.priority, "ray_job": ray.get_runtime_context().get_job_id()}
        if self.card is not None:
            entry["card"] = {"model": self.card.model.model_dump(mode="json"),
                             "train": self.card.train.model_dump(mode="json")}
        _internal_kv_put(self.job_id, json.dumps(entry), namespace=NAMESPACE)
        self._entered = True

    def enter(self) -> None:
        if self.since is None:
            self.since = time.time()
        self._put()

    def ahead(self) -> list[str]:
        line = waiting()
        mine = next((i for i, (job, _) in enumerate(line) if job == self.job_id), len(line))
        return [job for job, _ in line[:mine]]

    def hold(self) -> None:
        self.since = None
        self._put()

    def leave(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        if self._entered:
            _internal_kv_del(self.job_id, namespace=NAMESPACE)
            _internal_kv_del(self.job_id, namespace=ASKS)
            self.since, self._entered = None, False

    def priorities(self) -> dict[str, int]:
        return {job: int(e.get("priority", 0)) for job, e in entries().items()}

    def ask(self, job: str, nodes: list[str], share: bool = False) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        request = {"by": self.job_id, "priority": self.priority, "nodes": sorted(nodes), "share": share}
        _internal_kv_put(job, json.dumps(request), namespace=ASKS)

    def asked(self) -> YieldRequest | None:
        from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get

        raw = _internal_kv_get(self.job_id, namespace=ASKS)
        if raw is None:
            return None
        _internal_kv_del(self.job_id, namespace=ASKS)
        r = json.loads(raw)
        return YieldRequest(r["by"], int(r["priority"]), list(r["nodes"]), bool(r.get("share", False)))

    def sharing(self) -> dict[str, JobCard]:
        out = {}
        for job, e in entries().items():
            card = e.get("card")
            if card is not None:
                out[job] = JobCard(int(e.get("priority", 0)), ModelSpec.model_validate(card["model"]),
                                   TrainSpec.model_validate(card["train"]))
        return out
