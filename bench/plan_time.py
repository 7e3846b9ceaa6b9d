"""Wall time of the planning commands a user types: `hetspot plan` on every shipped example that plans, and
`--fleet auto` on the shipped catalog, each run as its own process (imports included), medians of `--runs`.

    python bench/plan_time.py [--runs 5] [--tree PATH] [--json]

`--tree` times another checkout of hetspot (a `git worktree` of an older commit) with this interpreter, so a
before and an after are measured on one machine in one sitting. Progress on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    ["plan", "examples/mixed-cluster.yaml"],
    ["plan", "examples/risk-cost.yaml"],
    ["plan", "examples/first-cloud-job.yaml"],
    ["plan", "examples/tiny-mixed.yaml"],
    ["plan", "examples/fleet-auto.yaml"],
    ["plan", "examples/risk-cost.yaml", "--fleet", "auto", "--catalog", "examples/catalog-aws.yaml"],
]
# examples/tiny-cluster.yaml has no cluster: (it plans on a running Ray cluster), so `plan` refuses it in one line


def run(tree: Path, args: list[str]) -> float:
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], cwd=tree, capture_output=True,
                          text=True)
    took = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"`hetspot {' '.join(args)}` in {tree} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", type=Path, default=ROOT, help="the hetspot checkout to time (default: this one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {}
    for cmd in COMMANDS:
        times = []
        for i in range(args.runs):
            times.append(run(args.tree, cmd))
            print(f"hetspot {' '.join(cmd)}: run {i + 1}/{args.runs} {times[-1]:.2f} s", file=sys.stderr, flush=True)
        out["hetspot " + " ".join(cmd)] = {"median_s": statistics.median(times), "runs_s": times}
    if args.json:
        print(json.dumps({"tree": str(args.tree), "runs": args.runs, "commands": out}, indent=2))
    else:
        print(f"wall time of each command, median of {args.runs} runs ({args.tree}):")
        for cmd, r in out.items():
            print(f"  {r['median_s']:6.2f} s  {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
