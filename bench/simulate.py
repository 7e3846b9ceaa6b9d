"""Goodput over real spot traces at fleet scale (`hetspot simulate`), for docs/benchmarks.md.

Usage: python bench/simulate.py [--traces DIR] [--quick] [--sensitivity] [--jobs]
Runs each trace in DIR (default examples/traces, the shipped Parcae traces) against two fleets and a 7B and a 70B
model, and prints one markdown row per run: tokens per strategy relative to the free re-plan
oracle (and the oracle that pays joined nodes' start-up), hetspot's goodput in place (with and without
warm-at-join) and on the restart path, and the simulation's own time. `--sensitivity`: hetspot's share of
the oracle on the 320-GPU fleet with the 70B, under both recovery paths, for a process start-up of 4, 13, 30
and 120 s, detection in 1 or 30 s, and a spot notice delivered (120 s) or not, with the share the oracle
paying start-up reaches. `--jobs`: several jobs on one fleet (`hetspot simulate --jobs`): the shipped day of jobs
(examples/jobs/team-day.yaml) on the 32-GPU fleet over each trace, first come first served against the fleet's
share chosen for weighted throughput.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.drills.fleet import Assumptions, FleetSim  # noqa: E402
from orchestrator.drills.trace import (
    load_fleet,  # noqa: E402
    load_trace,  # noqa: E402
)
from planner.specs import ModelSpec, TrainSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLEETS = ["a100-l4-t4-320", "mixed-1024"]
MODELS = ["7b", "70b"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--traces", default=str(ROOT / "examples" / "traces"),
                    help="a folder of spot traces (the shipped ones)")
    ap.add_argument("--quick", action="store_true", help="the 320-GPU fleet and the 7B model only")
    ap.add_argument("--sensitivity", action="store_true", help="the recovery sensitivity table instead")
    ap.add_argument("--jobs", action="store_true", help="the several-jobs table instead")
    args = ap.parse_args()
    traces = sorted(Path(args.traces).glob("*.jsonl"))
    if not traces:
        sys.exit(f"no *.jsonl traces in {args.traces}")
    if args.sensitivity:
        sensitivity(traces)
        return
    if args.jobs:
        several_jobs(traces)
        return
    a = Assumptions()
    print("| trace | fleet | model | hetspot | hetspot, no warm-at-join | hetspot, restart path | oracle paying "
          "start-up | s3-only | symmetric | oracle tokens (B) | hetspot goodput | recoveries | simulated in |")
    print("|---" * 13 + "|")
    for tr_path in traces:
        tr = load_trace(tr_path)
        for fleet_name in FLEETS[:1] if args.quick else FLEETS:
            fleet = load_fleet(ROOT / "examples" / "fleets" / f"{fleet_name}.yaml")
            for model in MODELS[:1] if args.quick else MODELS:
                t0 = time.perf_counter()
                out = FleetSim(tr, fleet, ModelSpec.preset(model), TrainSpec(global_batch=1024), a).run()
                took = time.perf_counter() - t0
                s = out["strategies"]
                o = s["oracle"]["tokens"]
                other = {way: FleetSim(tr, fleet, ModelSpec.preset(model), TrainSpec(global_batch=1024), b).run()[
                    "strategies"]["hetspot"]["tokens"] for way, b in (
                        ("cold", Assumptions(warm_at_join=False)), ("restart", Assumptions(recovery="restart")))}
                print(f"| {tr_path.stem} | {fleet.num_gpus} GPUs ({fleet_name}) | {model} | "
                      f"{s['hetspot']['tokens'] / o:.3f} | {other['cold'] / o:.3f} | {other['restart'] / o:.3f} | "
                      f"{s['oracle-startup']['tokens'] / o:.3f} | {s['s3-only']['tokens'] / o:.3f} | "
                      f"{s['symmetric']['tokens'] / o:.3f} | {o / 1e9:.2f} | {s['hetspot']['goodput'] * 100:.1f}% | "
                      f"{s['hetspot']['recoveries']} | {took:.1f} s |", flush=True)
    print("\nTokens relative to the free re-plan oracle (the faster of the planner's best plan and the running one "
          f"at every event, joined nodes at once, no start-up). Assumptions: {a.as_dict()}")


def sensitivity(traces: list[Path], fleet_name: str = "a100-l4-t4-320", model: str = "70b") -> None:
    """hetspot / oracle under both recovery paths as the start-up, the detection and the notice vary."""
    fleet = load_fleet(ROOT / "examples" / "fleets" / f"{fleet_name}.yaml")
    cols = [(st, d) for st in (4.0, 13.0, 30.0, 120.0) for d in (1.0, 30.0)]
    print(f"hetspot / oracle, {model} on {fleet.num_gpus} GPUs ({fleet_name})\n")
    print("| trace | notice | recovery | " + " | ".join(f"start-up {st:.0f} s, detect {d:.0f} s" for st, d in cols)
          + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for tr_path in traces:
        tr = load_trace(tr_path)
        for notice in (120.0, 0.0):
            for way in ("in-place", "restart"):
                row = []
                bound = []
                for st, d in cols:
                    a = Assumptions(recovery=way, startup_s=st, detect_s=d, notice_s=notice)
                    sim = FleetSim(tr, fleet, ModelSpec.preset(model), TrainSpec(global_batch=1024), a)
                    s = sim.run()["strategies"]
                    row.append(f"{s['hetspot']['tokens'] / s['oracle']['tokens']:.3f}")
                    bound.append(f"{s['oracle-startup']['tokens'] / s['oracle']['tokens']:.3f}")
                print(f"| {tr_path.stem} | {'120 s' if notice else 'none'} | {way} | " + " | ".join(row) + " |",
                      flush=True)
            print(f"| {tr_path.stem} | {'120 s' if notice else 'none'} | oracle paying start-up | "
                  + " | ".join(bound) + " |", flush=True)
    print(f"\nOther assumptions as `hetspot simulate`'s defaults (re-form {Assumptions().reform_s} s).")


def several_jobs(traces: list[Path], fleet_name: str = "a10g-l4-32", jobs_file: str = "team-day") -> None:
    """Weighted goodput, goodput, jobs finished and weighted completion time under each policy, per trace."""
    from orchestrator.drills.jobs_sim import JobsSim, load_jobs

    fleet = load_fleet(ROOT / "examples" / "fleets" / f"{fleet_name}.yaml")
    jobs = load_jobs(ROOT / "examples" / "jobs" / f"{jobs_file}.yaml")
    print("| trace | policy | weighted goodput | vs fcfs | goodput | jobs finished | weighted JCT (min) | "
          "node-set changes | longest wait with no GPU (min) | simulated in |")
    print("|---" * 10 + "|")
    for tr_path in traces:
        t0 = time.perf_counter()
        out = JobsSim(load_trace(tr_path), fleet, jobs).run()
        took = time.perf_counter() - t0
        base = out["policies"]["fcfs"]["weighted_goodput"]
        for name, p in out["policies"].items():
            jct = "-" if p["weighted_jct_min"] is None else f"{p['weighted_jct_min']:.1f}"
            wait = max(j["waited_min"] for j in p["jobs"].values())
            print(f"| {tr_path.stem} | {name} | {p['weighted_goodput']:.3f} | {p['weighted_goodput'] / base:.2f}x | "
                  f"{p['goodput']:.3f} | {p['finished']} of {len(p['jobs'])} | {jct} | {p['moves']} | {wait:.0f} | "
                  f"{took:.1f} s |", flush=True)
    print(f"\n{len(jobs)} jobs (examples/jobs/{jobs_file}.yaml) on {fleet.num_gpus} GPUs ({fleet_name}); weight = 1 + "
          "priority; goodput in fleets' worth of work per second (each job's tokens over its tokens/s on the whole "
          f"fleet); the share re-decided at every arrival, end and fleet change (hysteresis {out['hysteresis']:.0%}). "
          f"Assumptions: {out['assumptions']}")


if __name__ == "__main__":
    main()
