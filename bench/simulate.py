"""Goodput over real spot traces at fleet scale (`hetspot simulate`), for docs/benchmarks.md.

Usage: python bench/simulate.py [--traces DIR] [--quick]
Runs each trace in DIR (default ../shared/data/spot-traces) against two fleets and a 7B and a 70B
model, and prints one markdown row per run: tokens per strategy relative to the free re-plan
oracle, hetspot's goodput, and the simulation's own time.
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
    ap.add_argument("--traces", default=str(ROOT.parent / "shared" / "data" / "spot-traces"))
    ap.add_argument("--quick", action="store_true", help="the 320-GPU fleet and the 7B model only")
    args = ap.parse_args()
    traces = sorted(Path(args.traces).glob("*.jsonl"))
    if not traces:
        sys.exit(f"no *.jsonl traces in {args.traces}")
    a = Assumptions()
    print("| trace | fleet | model | hetspot | s3-only | symmetric | oracle tokens (B) | hetspot goodput | "
          "recoveries | simulated in |")
    print("|---|---|---|---|---|---|---|---|---|---|")
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
                print(f"| {tr_path.stem} | {fleet.num_gpus} GPUs ({fleet_name}) | {model} | "
                      f"{s['hetspot']['tokens'] / o:.3f} | {s['s3-only']['tokens'] / o:.3f} | "
                      f"{s['symmetric']['tokens'] / o:.3f} | {o / 1e9:.2f} | {s['hetspot']['goodput'] * 100:.1f}% | "
                      f"{s['hetspot']['recoveries']} | {took:.1f} s |", flush=True)
    print(f"\nTokens relative to the free re-plan oracle. Assumptions: {a.as_dict()}")


if __name__ == "__main__":
    main()
