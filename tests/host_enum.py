"""Does any plan fit? A brute-force witness finder for host memory as a node total.

Independent of planner/search.py and planner/offload_policy.py: for every ordered selection of TP-1
groups as one pipeline (a single replica holds the least state), every contiguous layer split (empty
stages allowed at the ends), one-sample micro-batches, and per stage the offload mode that needs the
least host memory among those that fit the GPU (with the fewest recomputed layers that fit, by a
linear scan), it checks each node's offloaded bytes against the node's whole host RAM. The first
split that fits is built as a Plan, and `evaluate` must accept it: that plan is the witness.
It finds fewer plans than exist (no TP, no data parallelism), so it can only show that a plan
exists, never that none does.
"""

from __future__ import annotations

import itertools
from functools import cache

from planner import cost, evaluate
from planner.offload_policy import to_policy
from planner.plan_types import Pipeline, Plan, Stage
from planner.specs import ClusterSpec, ModelSpec, TrainSpec

MODES = ((False, False), (True, False), (True, True))


def some_valid_plan(cluster: ClusterSpec, model: ModelSpec, train: TrainSpec) -> Plan | None:
    gpus = [(n.name, d) for n in cluster.nodes for d in n.device_ids()]
    slots = {n.name: cost.make_slot(cluster, train, n.name, 1) for n in cluster.nodes}
    host_cap = {n.name: n.host_mem * cost.GIB for n in cluster.nodes}
    num_layers, batch = model.num_layers, train.global_batch

    @cache
    def least_host(node: str, n: int, first: bool, last: bool, inflight: int):
        """(host bytes, Knobs) of the fitting mode that needs the least host memory, or None."""
        shape = cost.StageShape(n, first, last)
        best = None
        for opt, par in MODES:
            for r in range(n + 1):
                kn = cost.Knobs(r, opt, par)
                if cost.stage_memory(slots[node], model, train, shape, 1, inflight, kn) <= slots[node].mem_cap_bytes:
                    h = cost.host_bytes(model, train, shape, 1, kn)
                    if best is None or h < best[0]:
                        best = (h, kn)
                    break
        return best

    for k in range(1, len(gpus) + 1):
        for seq in itertools.permutations(gpus, k):
            for cuts in itertools.combinations_with_replacement(range(num_layers + 1), k - 1):
                bounds = (0, *cuts, num_layers)
                sizes = [bounds[i + 1] - bounds[i] for i in range(k)]
                if any(s == 0 for s in sizes[1:-1]):
                    continue  # only the first and the last stage may hold no layer
                need: dict[str, float] = {}
                chosen = []
                for i, ((node, _), n) in enumerate(zip(seq, sizes, strict=True)):
                    got = least_host(node, n, i == 0, i == k - 1, cost.inflight(i, k, batch, "1f1b"))
                    if got is None:
                        break
                    need[node] = need.get(node, 0.0) + got[0]
                    chosen.append(got[1])
                else:
                    if all(need[nd] <= host_cap[nd] for nd in need):
                        stages = [Stage(layer_start=bounds[i], layer_end=bounds[i + 1],
                                        gpu_type=cluster.node(node).gpu_type, node=node, devices=[dev],
                                        offload=to_policy(kn, bounds[i]))
                                  for i, ((node, dev), kn) in enumerate(zip(seq, chosen, strict=True))]
                        p = Plan(model_name=model.name, num_layers=num_layers, global_batch=batch,
                                 pipelines=[Pipeline(num_samples=batch, micro_batch_size=1,
                                                     num_micro_batches=batch, stages=stages)])
                        p.estimate = evaluate(p, cluster, model, train)  # the witness must be accepted
                        return p
    return None
