"""Planner against exhaustive enumeration on random small clusters.

    python bench/optimality.py [--clusters 200] [--seed 1] [--cli 3]

Draws clusters of at most 8 GPUs on up to 4 nodes, each node with its own network (NIC 1-25 GB/s,
intra-node 16-300 GB/s), GPU types mixed, models of 2-4 layers with 12, 16, 24 or 48 heads (so TP3 and
TP6 divide some), global batch 1-6. For each it times `planner.plan` and runs tests/enumerator.py's
brute force (every plan the contract allows, stages of different TP degrees included) below the
planner's time; it prints the ratio of the planner's throughput to the optimum, how many plans mix TP
degrees, and the slowest plan times. `--cli N` also times `hetspot plan` as
a user runs it (a job file, a new process) on the N clusters that planned slowest.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

import yaml  # noqa: E402

from planner import ClusterSpec, ModelSpec, NodeSpec, TrainSpec, plan  # noqa: E402
from tests.enumerator import best_plan  # noqa: E402

TYPES = ["A100-80GB", "A100-40GB", "L4", "T4", "V100-16GB", "H100-SXM"]


def draw(rng: random.Random):
    types = rng.sample(TYPES, rng.randint(1, 3))
    nodes, total = [], 0
    for i in range(rng.randint(1, 4)):
        g = rng.randint(1, 4)
        if total + g > 8:
            break
        total += g
        nodes.append(dict(name=f"n{i}", gpu_type=rng.choice(types), num_gpus=g,
                          inter_node_bw_gb_s=rng.choice([1.0, 3.0, 12.5, 25.0]),
                          intra_node_bw_gb_s=rng.choice([None, 16.0, 300.0])))
    heads = rng.choice([12, 16, 24, 48])
    model = dict(name="t", num_layers=rng.randint(2, 4), hidden_size=heads * rng.choice([64, 128]), num_heads=heads,
                 vocab_size=rng.choice([32000, 50304]), seq_len=rng.choice([1024, 2048, 4096]))
    train = dict(global_batch=rng.randint(1, 6), memory_reserve_gib=rng.choice([2.0, 8.0]), max_micro_batch_size=4)
    return nodes, model, train


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--cli", type=int, default=3, help="time `hetspot plan` on this many of the slowest")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    rows, mixed = [], 0
    for i in range(args.clusters):
        nodes, model_d, train_d = draw(rng)
        cluster = ClusterSpec(nodes=[NodeSpec(**n) for n in nodes])
        model, train = ModelSpec(**model_d), TrainSpec(**train_d)
        t0 = time.perf_counter()
        try:
            p = plan(cluster, model, train)
            got = p.estimate.step_time_s
            mixed += len({st.tp for pp in p.pipelines for st in pp.stages}) > 1
        except ValueError:
            got = math.inf
        plan_s = time.perf_counter() - t0
        best, layout = best_plan(cluster, model, train, bound=got * (1 + 1e-9))
        ratio = 1.0 if layout is None else best / got  # throughput of the plan over the optimum's
        rows.append((ratio, plan_s, i, (nodes, model_d, train_d)))
        if (i + 1) % 50 == 0:
            print(f"{i + 1} clusters ...", flush=True)
    ratios = [r for r, *_ in rows]
    times = sorted(t for _, t, *_ in rows)
    print(f"clusters: {len(rows)}; at least 0.99 of the optimum: {sum(r >= 0.99 for r in ratios)}; "
          f"worst {min(ratios):.4f}; plans mixing TP degrees {mixed}; median plan {statistics.median(times):.2f} s, "
          f"slowest {times[-1]:.2f} s")
    for ratio, t, i, _ in sorted(rows, key=lambda r: r[0])[:3]:
        print(f"  lowest ratios: cluster {i}: {ratio:.4f} (plan {t:.2f} s)")
    slow = sorted(rows, key=lambda r: -r[1])[:args.cli]
    with tempfile.TemporaryDirectory() as tmp:
        for _, t, i, (nodes, model_d, train_d) in slow:
            job = Path(tmp) / f"c{i}.yaml"
            job.write_text(yaml.safe_dump({"name": f"small-{i}", "model": model_d, "train": train_d,
                                           "cluster": {"nodes": [{k: v for k, v in n.items() if v is not None}
                                                                 for n in nodes]}}))
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                r = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", "plan", str(job)], cwd=ROOT,
                                   capture_output=True, text=True)
                walls.append(time.perf_counter() - t0)
            print(f"  `hetspot plan` on cluster {i} (in-process plan {t:.2f} s): exit {r.returncode}, "
                  f"median wall {statistics.median(walls):.2f} s of 3")


if __name__ == "__main__":
    main()
