"""The queue of hetspot jobs on one Ray cluster that wait for GPUs other jobs hold.

A job whose minimum (the smallest plan that trains) does not fit on the GPUs free to it waits in the controller's
`queued` state instead of failing. The queue orders the waiting jobs first come, first served: each keeps an entry
under its job id in the GCS's key-value store (namespace `hetspot-queue`), with the time it first entered and its
Ray job; only the first job in line takes GPUs that come free, so a job that waits longer is never overtaken by
one that came later. An entry whose Ray job is dead (a driver killed before its controller left the queue) is
dropped by whoever reads it next, as the autoscaler demand's entries are (cluster/job_entries.py).

A job that can train on what is free does not look at the queue: the queue orders only jobs that cannot.
"""

from __future__ import annotations

import json
import time

NAMESPACE = "hetspot-queue"


def waiting() -> list[tuple[str, float]]:
    """(job id, UNIX time it entered) of every job waiting on the connected cluster, first first; the entries of
    jobs whose Ray job is dead are deleted."""
    from orchestrator.cluster.job_entries import live_entries

    line = [(job, float(e["since"])) for job, e in live_entries(NAMESPACE, "place in the queue").items()]
    return sorted(line, key=lambda e: (e[1], e[0]))


class RayJobQueue:
    """One job's place in its cluster's queue (control/protocols.JobQueue)."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.since: float | None = None

    def enter(self) -> None:
        import ray
        from ray.experimental.internal_kv import _internal_kv_put

        if self.since is None:
            self.since = time.time()
        entry = {"since": self.since, "ray_job": ray.get_runtime_context().get_job_id()}
        _internal_kv_put(self.job_id, json.dumps(entry), namespace=NAMESPACE)

    def ahead(self) -> list[str]:
        line = waiting()
        mine = next((i for i, (job, _) in enumerate(line) if job == self.job_id), len(line))
        return [job for job, _ in line[:mine]]

    def leave(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        if self.since is not None:
            _internal_kv_del(self.job_id, namespace=NAMESPACE)
            self.since = None
