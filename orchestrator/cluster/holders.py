"""Whose are a cluster's GPUs: a job plans on the GPUs free to it, never on another job's.

Ray's `ray.nodes()` reports each node's total GPUs, whoever holds them, so a second job on a cluster would plan on
the first job's GPUs too and wait for placement groups that cannot be placed. Every hetspot worker holds its GPU
through a placement group named `hetspot:<job id>:<suffix>` (`pg_name`), so the cluster's placement group table
says which job holds which GPUs. A GPU is free to a job when Ray counts it available (no placement group reserves
it, no task or actor uses it) or when it is in one of the job's own placement groups (its kept processes and warm
workers); GPUs of other hetspot jobs are named with their job, GPUs anything else holds are counted as "other".
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PG_PREFIX = "hetspot:"
OTHER = "other Ray work"  # the holder of GPUs that no hetspot job's placement group reserves


def job_id() -> str:
    """This process's hetspot job: the id `hetspot submit` gave it (its Ray job's environment), or "local"."""
    from orchestrator.runtime.progress_lines import ENV_ID

    return os.environ.get(ENV_ID, "local")


def pg_name(job: str | None = None) -> str:
    """A worker's placement group name: the job that holds it, and a suffix that keeps names distinct."""
    return f"{PG_PREFIX}{job or job_id()}:{uuid.uuid4().hex[:12]}"


def job_of(name: str) -> str | None:
    """The hetspot job a placement group name says holds it; None for a group hetspot did not make."""
    if not name.startswith(PG_PREFIX):
        return None
    return name[len(PG_PREFIX):].rsplit(":", 1)[0] or None


def held_by_job(table: Mapping[str, Mapping[str, Any]]) -> dict[str, Counter[str]]:
    """Ray node id -> {hetspot job: GPUs its placement groups reserve there}, from `ray.util.placement_group_table()`.
    A removed group holds nothing; a bundle not placed yet has no node."""
    out: dict[str, Counter[str]] = {}
    for pg in table.values():
        job = job_of(pg.get("name") or "")
        if job is None or pg.get("state") == "REMOVED":
            continue
        for idx, res in (pg.get("bundles") or {}).items():
            node = (pg.get("bundles_to_node_id") or {}).get(idx)
            gpus = float(res.get("GPU", 0))
            if node and gpus:
                out.setdefault(node, Counter())[job] += int(gpus)
    return out


def free_for_job(nodes: list, job: str, table: Mapping[str, Mapping[str, Any]],
                 available: Mapping[str, Mapping[str, float]] | None = None) -> tuple[list, dict[str, dict[str, int]]]:
    """(the nodes with `num_gpus` the GPUs free to `job`, those with none left out; per node name, who holds the
    others and how many). `nodes`: DiscoveredNodes (their `node_id` is Ray's); `table`: the placement group table;
    `available`: Ray node id -> its available resources (None where it could not be read: then only other hetspot
    jobs' placement groups are subtracted)."""
    held = held_by_job(table)
    free, holders = [], {}
    for n in nodes:
        on = held.get(n.node_id, Counter())
        own = on.get(job, 0)
        others = {j: c for j, c in on.items() if j != job}
        count = n.num_gpus - sum(others.values())
        if available is not None and n.node_id in available:
            unreserved = int(available[n.node_id].get("GPU", 0))
            elsewhere = n.num_gpus - sum(on.values()) - unreserved  # in use, but by no hetspot placement group
            if elsewhere > 0:
                others[OTHER] = elsewhere
            count = min(count, unreserved + own)
        if others:
            holders[n.name] = dict(sorted(others.items()))
        if count > 0:
            free.append(dataclasses.replace(n, num_gpus=count))
    return free, holders


def table_from_state_api(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The State API's placement groups (`list_placement_groups(detail=True)`, what the dashboard serves over
    HTTP) in `ray.util.placement_group_table()`'s form: bundles by index, and each bundle's node."""
    table = {}
    for i, pg in enumerate(rows):
        bundles, nodes = {}, {}
        for j, b in enumerate(pg.get("bundles") or []):
            idx = (b.get("bundle_id") or {}).get("bundle_index", j)
            bundles[idx] = b.get("unit_resources") or b.get("unitResources") or {}
            nodes[idx] = b.get("node_id") or b.get("nodeId") or ""
        table[pg.get("placement_group_id") or str(i)] = {"name": pg.get("name") or "", "state": pg.get("state"),
                                                         "bundles": bundles, "bundles_to_node_id": nodes}
    return table


def ray_free_for_job(nodes: list, job: str | None = None,
                     table_fn: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
                     available_fn: Callable[[], Mapping[str, Mapping[str, float]]] | None = None
                     ) -> tuple[list, dict[str, dict[str, int]]]:
    """`free_for_job` on the connected Ray cluster's placement group table and available resources."""
    if table_fn is None:
        from ray.util import placement_group_table

        table_fn = placement_group_table
    if available_fn is None:
        from ray._private.state import available_resources_per_node  # Ray's own per-node view (no public API)

        available_fn = available_resources_per_node
    try:
        available = available_fn()
    except Exception:  # noqa: BLE001 - a Ray without this view: other hetspot jobs' groups are still subtracted
        available = None
    return free_for_job(nodes, job or job_id(), table_fn(), available)
