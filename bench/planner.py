"""Planner benchmark: heterogeneity pays (planner vs baselines) and planning time at scale.

    python bench/planner.py            # both parts, prints markdown tables
    python bench/planner.py --quick    # one run of each (the 4,096-GPU plan alone takes about a minute)
    python bench/planner.py --warm-only  # the warm re-plan table at 1,024 to 16,384 GPUs
    python bench/planner.py --quick --no-warm  # all but it, one run each (docs/benchmarks.md)
    python bench/planner.py --warm-only --collector-on  # the same with the garbage collector left on
    python bench/planner.py --baseline-sweep  # where the planner loses to a baseline on small clusters
    python bench/planner.py --cold 16384 --repeats 3 [--planner-from DIR]  # the cold first plan (another tree's)

All throughputs come from the same cost model (planner.evaluate). Times are
medians of repeated runs on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

# This file is named like the package it measures; import the package, not itself (or, with --planner-from DIR,
# another tree's: another commit's planner timed by this bench, as in `git worktree add /tmp/old REV`).
_FROM = sys.argv[sys.argv.index("--planner-from") + 1] if "--planner-from" in sys.argv[:-1] else None
sys.path[0] = _FROM or str(Path(__file__).resolve().parents[1])

import planner.search as search  # noqa: E402
from planner import ClusterSpec, ModelSpec, NodeSpec, PlanningError, TrainSpec  # noqa: E402
from planner.baselines import all_baselines  # noqa: E402
from planner.cost import peak_flops  # noqa: E402
from planner.search import Planner  # noqa: E402


def _cluster(*groups: tuple[str, int, int]) -> ClusterSpec:
    """groups: (gpu_type, gpus per node, number of nodes)."""
    nodes, i = [], 0
    for gpu_type, per_node, count in groups:
        for _ in range(count):
            nodes.append(NodeSpec(name=f"{gpu_type.lower()}-{i}", gpu_type=gpu_type, num_gpus=per_node))
            i += 1
    return ClusterSpec(nodes=nodes)


CASES = [
    ("8x A100-40GB + 16x V100-32GB", _cluster(("A100-40GB", 8, 1), ("V100-32GB", 8, 2)), "7b", 256),
    ("4x H100 + 8x A10G + 8x T4", _cluster(("H100-SXM", 4, 1), ("A10G", 4, 2), ("T4", 4, 2)), "7b", 256),
    ("16x L4 + 4x A100-80GB", _cluster(("L4", 4, 4), ("A100-80GB", 4, 1)), "7b", 256),
    ("8x H100 + 16x L40S + 8x RTX4090", _cluster(("H100-SXM", 8, 1), ("L40S", 8, 2), ("RTX4090", 4, 2)), "13b", 512),
    ("4x A100-80GB + 8x L4 + 4x T4", _cluster(("A100-80GB", 4, 1), ("L4", 4, 2), ("T4", 4, 1)), "gpt-1.3b", 128),
    ("8x MI300X + 16x A10G", _cluster(("MI300X", 8, 1), ("A10G", 8, 2)), "13b", 512),
]


def heterogeneity() -> None:
    print("## Heterogeneity pays: tokens/s by cost model (speedup of hetspot over each)\n")
    print("| cluster | model | hetspot tok/s | megatron-symmetric | data-parallel+offload | best-homogeneous |")
    print("|---|---|---|---|---|---|")
    speedups = []
    for name, cluster, preset, batch in CASES:
        model, train = ModelSpec.preset(preset), TrainSpec(global_batch=batch)
        best = Planner(model, train).plan(cluster)
        cells = []
        for key, bp in all_baselines(cluster, model, train).items():
            if bp is None:
                cells.append("does not fit")
                continue
            x = bp.estimate.step_time_s / best.estimate.step_time_s
            assert x >= 1 - 1e-9, f"planner below {key} on {name}"
            cells.append(f"{bp.estimate.tokens_per_s:,.0f} ({x:.2f}x)")
            if key == "megatron-symmetric":
                speedups.append(x)
        print(f"| {name} | {preset} | {best.estimate.tokens_per_s:,.0f} | " + " | ".join(cells) + " |")
    print(f"\nMean speedup over Megatron-style symmetric: {statistics.mean(speedups):.2f}x "
          f"(min {min(speedups):.2f}x); hetspot is never below a baseline.\n")


def scale(title: str, cluster: ClusterSpec, preset: str, batch: int, lost: set[str], repeats: int,
          targets: str, spread: set[str] | None = None) -> None:
    """Plan the cluster, then re-plan after losing the `lost` nodes (warm caches), `repeats` times; with
    `spread`, also re-plan (from the same first plan) after losing those nodes instead."""
    model, train = ModelSpec.preset(preset), TrainSpec(global_batch=batch)
    survivors = cluster.without_nodes(lost)
    first, again, other = [], [], []
    for _ in range(repeats):
        planner = Planner(model, train)
        t0 = time.perf_counter()
        p = planner.plan(cluster)
        first.append(time.perf_counter() - t0)
        if spread:
            warm = planner.sharing_caches()
            warm.plan(cluster)
            t0 = time.perf_counter()
            p3 = warm.plan(cluster.without_nodes(spread))
            other.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        p2 = planner.plan(survivors)
        again.append(time.perf_counter() - t0)
    print(f"## Scale: {title}\n")
    print("| step | median s | runs | result |")
    print("|---|---|---|---|")
    print(f"| plan {cluster.num_gpus:,} GPUs | {statistics.median(first):.2f} | {repeats} | "
          f"{len(p.pipelines)} pipelines, {p.estimate.tokens_per_s:,.0f} tok/s |")
    print(f"| re-plan after losing {len(lost)} nodes ({cluster.num_gpus - survivors.num_gpus} GPUs) | "
          f"{statistics.median(again):.2f} | {repeats} | {len(p2.pipelines)} pipelines, "
          f"{p2.estimate.tokens_per_s:,.0f} tok/s |")
    flops = {n.name: n.num_gpus * peak_flops(n.gpu_type) * cluster.efficiency(n.gpu_type) for n in cluster.nodes}
    f_gpu = 1 - survivors.num_gpus / cluster.num_gpus
    f_flops = 1 - sum(flops[n.name] for n in survivors.nodes) / sum(flops.values())
    kinds = ", ".join(sorted({cluster.node(n).gpu_type for n in lost}))
    print(f"\nRe-plan retention: {p2.estimate.tokens_per_s / p.estimate.tokens_per_s:.1%} of the predicted tokens/s "
          f"after losing {f_gpu:.2%} of the GPUs ({kinds}), which held {f_flops:.2%} of the cluster's FLOP/s: the "
          f"(1 - f) - 2% goal is {1 - f_gpu - 0.02:.2%} by GPU count, {1 - f_flops - 0.02:.2%} by FLOP/s.")
    if spread:
        kinds = ", ".join(f"{sum(cluster.node(n).gpu_type == t for n in spread)}x {t}"
                          for t in sorted({cluster.node(n).gpu_type for n in spread}))
        f_gpu = 1 - cluster.without_nodes(spread).num_gpus / cluster.num_gpus
        print(f"\nRe-plan after losing {len(spread)} nodes spread over the types instead ({kinds} nodes; median "
              f"{statistics.median(other):.2f} s): {p3.estimate.tokens_per_s:,.0f} tok/s, retention "
              f"{p3.estimate.tokens_per_s / p.estimate.tokens_per_s:.1%} against the (1 - f) - 2% goal of "
              f"{1 - f_gpu - 0.02:.2%}.")
    print(f"\nTargets: {targets} on a 2-core machine.\n")


def warm_replans(sizes: tuple[int, ...], repeats: int) -> None:
    """CPU time of a warm re-plan after losing 32 nodes spread over every type, at each size (175B,
    6 types round robin, nodes of 8); the warm plan against a fresh search on the survivors."""
    types = ["H100-SXM", "A100-80GB", "A100-40GB", "L40S", "A10G", "L4"]
    model, train = ModelSpec.preset("175b"), TrainSpec(global_batch=2048)
    print("## Warm re-plan at scale (175B, 6 types, nodes of 8, 32 nodes lost spread over the types)\n")
    print("| GPUs | types lost | first plan CPU s | warm re-plan CPU s (median) | runs | before tok/s | warm tok/s "
          "(kept) | fresh search tok/s (CPU s) | longer search tok/s | fresh / best | broken pipelines dropped tok/s "
          "(kept) |")
    print("|---" * 11 + "|")
    for gpus in sizes:
        nodes = gpus // 8
        cluster = _round_robin(types, nodes)
        lost = spread_loss(cluster, 32)
        survivors = cluster.without_nodes(lost)
        first, warm = [], []
        for _ in range(repeats):
            planner = Planner(model, train)
            t0 = time.process_time()
            p1 = planner.plan(cluster)
            first.append(time.process_time() - t0)
            t0 = time.process_time()
            p2 = planner.plan(survivors)
            warm.append(time.process_time() - t0)
        t0 = time.process_time()
        fresh = Planner(model, train).plan(survivors)
        fresh_s = time.process_time() - t0
        longer = Planner(model, train)
        longer.thorough = True  # every start descended, not only the best of each kind
        longer_plan = longer.plan(survivors)
        best = max(p2.estimate.tokens_per_s, longer_plan.estimate.tokens_per_s)
        dropped = search.kept_pipelines(p1, survivors, model, train)
        before = p1.estimate.tokens_per_s
        drop = (f"{dropped.estimate.tokens_per_s:,.0f} ({dropped.estimate.tokens_per_s / before:.1%})"
                if dropped else "-")
        print(f"| {gpus:,} | {len({cluster.node(n).gpu_type for n in lost})} of {len(types)} | "
              f"{statistics.median(first):.2f} | {statistics.median(warm):.2f} | {repeats} | {before:,.0f} | "
              f"{p2.estimate.tokens_per_s:,.0f} ({p2.estimate.tokens_per_s / before:.1%}) | "
              f"{fresh.estimate.tokens_per_s:,.0f} ({fresh_s:.2f}) | {longer_plan.estimate.tokens_per_s:,.0f} | "
              f"{fresh.estimate.tokens_per_s / best:.3f} | {drop} |")
    print("\nTargets: a warm re-plan at most 1 s of CPU at 16,384 GPUs, its plan no slower than a fresh search's "
          "or than the last plan with its broken pipelines dropped; a fresh search within 2% of the best of the "
          "warm re-plan and a longer search (every start descended).\n")


def cold_plans(gpus: int, repeats: int) -> None:
    """CPU seconds of the first (cold) plan of the warm re-plan table's cluster at `gpus` GPUs, each in a fresh
    planner (caches empty), and the plan's tokens/s."""
    types = ["H100-SXM", "A100-80GB", "A100-40GB", "L40S", "A10G", "L4"]
    cluster = _round_robin(types, gpus // 8)
    times, got = [], 0.0
    for _ in range(repeats):
        planner = Planner(ModelSpec.preset("175b"), TrainSpec(global_batch=2048))
        t0 = time.process_time()
        got = planner.plan(cluster).estimate.tokens_per_s
        times.append(time.process_time() - t0)
    print(f"cold plan, 175B on {gpus:,} GPUs ({len(types)} types, nodes of 8), planner from "
          f"{Path(sys.path[0]).resolve()}: CPU s {', '.join(f'{t:.2f}' for t in times)} (median "
          f"{statistics.median(times):.2f}); {got:,.0f} tokens/s")


def spread_loss(cluster: ClusterSpec, count: int) -> set[str]:
    """`count` nodes evenly over the cluster's node list, the k-th of GPU type k mod (number of types): every type
    loses nodes (a fixed stride over a round-robin list hits only the types its stride meets)."""
    types = sorted({n.gpu_type for n in cluster.nodes})
    by_type = {t: [n.name for n in cluster.nodes if n.gpu_type == t] for t in types}
    lost: set[str] = set()
    for k in range(count):
        names = by_type[types[k % len(types)]]
        j = (k // len(types)) * len(names) * len(types) // count  # spread over that type's nodes too
        lost.add(next(n for n in names[j:] + names[:j] if n not in lost))
    return lost


def baseline_sweep() -> None:
    """Small single-type clusters on which the planner loses to a baseline under its own cost model (every
    baseline is a plan it could have chosen): 4 GPU types x 1, 2 or 4 GPUs a node x 1 or 2 nodes x 4 models x
    batch 16 or 64 x 16 or 64 GiB of host RAM a node, 384 clusters."""
    import itertools

    losses, t0 = [], time.process_time()
    for gpu, per_node, nodes, preset, batch, host in itertools.product(
            ["T4", "L4", "A10G", "A100-40GB"], [1, 2, 4], [1, 2], ["gpt-125m", "gpt-350m", "gpt-1.3b", "7b"],
            [16, 64], [16, 64]):
        cluster = ClusterSpec(nodes=[NodeSpec(name=f"n{i}", gpu_type=gpu, num_gpus=per_node, host_mem_gib=host,
                                              inter_node_bw_gb_s=12.5) for i in range(nodes)])
        model, train = ModelSpec.preset(preset), TrainSpec(global_batch=batch)
        try:
            mine = Planner(model, train).plan(cluster).estimate.step_time_s
        except PlanningError:
            mine = float("inf")
        for name, other in all_baselines(cluster, model, train).items():
            if other is not None and mine > other.estimate.step_time_s * (1 + 1e-9):
                losses.append((mine / other.estimate.step_time_s, gpu, per_node, nodes, preset, batch, host, name))
    print("## The planner against every baseline (384 small clusters)\n")
    print(f"{len(losses)} losses ({time.process_time() - t0:.0f} s CPU)" + (":" if losses else ""))
    for x, gpu, per_node, nodes, preset, batch, host, name in sorted(losses, reverse=True):
        print(f"- {name} faster by {x - 1:.1%}: {nodes} node(s) of {per_node} {gpu}, {preset}, batch {batch}, "
              f"{host} GiB host RAM a node")


def _round_robin(types: list[str], nodes: int) -> ClusterSpec:
    return ClusterSpec(nodes=[NodeSpec(name=f"n{i:03d}", gpu_type=types[i % len(types)], num_gpus=8)
                              for i in range(nodes)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warm-only", action="store_true", help="only the warm re-plan table")
    ap.add_argument("--no-warm", action="store_true", help="all but the warm re-plan table")
    ap.add_argument("--baseline-sweep", action="store_true", help="only the sweep of small clusters on which "
                    "the planner loses to a baseline")
    ap.add_argument("--collector-on", action="store_true", help="leave Python's garbage collector on during "
                    "searches (planner.search.collector_paused), to measure what pausing it saves")
    ap.add_argument("--cold", type=int, metavar="GPUS", help="only the cold first plan at GPUS GPUs (the warm "
                    "re-plan table's cluster), --repeats times, each in a fresh planner")
    ap.add_argument("--repeats", type=int, default=1, help="with --cold: how many plans")
    ap.add_argument("--planner-from", metavar="DIR", help="time the planner package of another tree (a worktree of "
                    "another commit) with this bench")
    args = ap.parse_args()
    if args.cold:
        cold_plans(args.cold, args.repeats)
        return
    if args.collector_on:
        search.collector_paused = contextlib.nullcontext
    if args.baseline_sweep:
        baseline_sweep()
        return
    if args.warm_only:
        warm_replans((1024, 4096, 8192, 16384), 1 if args.quick else 3)
        return
    heterogeneity()
    repeats = 1 if args.quick else 5
    scale("70B on 1,024 GPUs (4 types, 128 nodes of 8)", _round_robin(["H100-SXM", "A100-80GB", "A10G", "L4"], 128),
          "70b", 1024, {f"n{i:03d}" for i in range(0, 64, 8)}, repeats, "plan <= 5 s, re-plan <= 1 s",
          spread={f"n{i:03d}" for i in (0, 1, 2, 3, 64, 65, 66, 67)})
    scale("175B on 4,096 GPUs (6 types, 512 nodes of 8)",
          _round_robin(["H100-SXM", "A100-80GB", "A100-40GB", "L40S", "A10G", "L4"], 512), "175b", 2048,
          {f"n{i:03d}" for i in range(0, 512, 16)}, repeats, "plan <= 10 s, re-plan <= 1 s")
    if not args.no_warm:
        warm_replans((1024, 4096, 8192, 16384), 1 if args.quick else 3)


if __name__ == "__main__":
    main()
