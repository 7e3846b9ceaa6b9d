"""Per-job entries in the GCS's key-value store, kept while the job's Ray job lives.

The autoscaler demand ledger (capacity.DemandLedger) and the job queue (job_queue.py) each keep one entry a job,
under the job's id in a namespace of their own, with the Ray job that wrote it (`ray_job`). A driver killed
before it removed its entry leaves it behind: whoever reads the entries next deletes those of dead Ray jobs.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger("hetspot.cluster")


def live_entries(namespace: str, what: str) -> dict[str, dict]:
    """job id -> its entry in `namespace`, of jobs whose Ray job is alive; the dead ones' entries are deleted
    (logged as the job's `what`)."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    dead = {j["JobID"] for j in ray._private.state.state.job_table() if j.get("IsDead")}
    out = {}
    for key in _internal_kv_list("", namespace=namespace):
        raw = _internal_kv_get(key, namespace=namespace)
        if raw is None:  # removed between the listing and the read
            continue
        entry = json.loads(raw)
        if entry.get("ray_job") in dead:
            _internal_kv_del(key, namespace=namespace)
            log.info("dropped the %s of job %s: its driver is gone", what, key.decode())
            continue
        out[key.decode()] = entry
    return out
