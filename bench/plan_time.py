"""Wall time of the planning commands a user types: `hetspot plan` on every shipped example that plans, and
`--fleet auto` on the shipped catalog, each run as its own process (imports included), medians of `--runs`.

    python bench/plan_time.py [--runs 5] [--tree PATH ...] [--bytecode compiled|none] [--json]

`--tree` times another checkout of hetspot (a `git worktree` of an older commit) with this interpreter; given
more than once, the trees take turns run by run, so a before and an after are measured on one machine in one
sitting under the same load. `--bytecode compiled` (the default) compiles each tree's modules first, as
`pip install` does and as Python itself does on a command's first run wherever it may write `__pycache__`;
`none` removes them and runs with PYTHONDONTWRITEBYTECODE=1, so every run compiles hetspot's modules again
(what a machine that forbids writing bytecode pays). Each run's CPU time (user + system, every process it
started) is reported beside its wall time: `--fleet auto` plans fleets in parallel processes.
A shared machine's speed can wander by about 2x over minutes (the project's 2-core machines do), so every
round also times a reference workload (`reference_s`: ten million additions in this process) and the table
prints its median beside the commands: figures from two sittings compare only with their references beside
them.
Progress on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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


PACKAGES = ["planner", "workers", "orchestrator"]


def run(tree: Path, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """One run of `hetspot ARGS` in `tree`: (wall s, CPU s of every process it started)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli.main", *args], cwd=tree, capture_output=True,
                          text=True, env=env)
    took = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"`hetspot {' '.join(args)}` in {tree} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def reference_s() -> float:
    """Seconds of a fixed pure-Python workload (ten million additions), timed between rounds: the machine's speed
    at the moment, for reading the commands' times."""
    t = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    return time.perf_counter() - t


def prepare(tree: Path, bytecode: str) -> dict[str, str]:
    """Compile the tree's modules (or remove their bytecode); the environment its runs get."""
    env = dict(os.environ)
    if bytecode == "compiled":
        subprocess.run([sys.executable, "-m", "compileall", "-q", *PACKAGES], cwd=tree, check=True)
    else:
        for pkg in PACKAGES:
            for cache in (tree / pkg).rglob("__pycache__"):
                shutil.rmtree(cache)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tree", type=Path, action="append",
                    help="a hetspot checkout to time (default: this one); repeat to alternate trees")
    ap.add_argument("--bytecode", choices=["compiled", "none"], default="compiled")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    trees = args.tree or [ROOT]
    envs = {tree: prepare(tree, args.bytecode) for tree in trees}
    out: dict[str, dict] = {str(tree): {} for tree in trees}
    refs: list[float] = []
    for cmd in COMMANDS:
        name = "hetspot " + " ".join(cmd)
        runs: dict[Path, list[tuple[float, float]]] = {tree: [] for tree in trees}
        for i in range(args.runs):
            refs.append(reference_s())
            print(f"reference workload: {refs[-1]:.2f} s", file=sys.stderr, flush=True)
            for tree in trees:
                runs[tree].append(run(tree, cmd, envs[tree]))
                wall, cpu = runs[tree][-1]
                print(f"{name} ({tree}): run {i + 1}/{args.runs} {wall:.2f} s (CPU {cpu:.2f} s)", file=sys.stderr,
                      flush=True)
        for tree in trees:
            walls, cpus = [w for w, _ in runs[tree]], [c for _, c in runs[tree]]
            out[str(tree)][name] = {"median_s": statistics.median(walls), "runs_s": walls,
                                    "median_cpu_s": statistics.median(cpus), "cpu_s": cpus}
    if args.json:
        print(json.dumps({"runs": args.runs, "bytecode": args.bytecode, "reference_s": refs,
                          "reference_median_s": statistics.median(refs), "trees": out}, indent=2))
    else:
        print(f"reference workload (ten million additions), median of {len(refs)}: {statistics.median(refs):.2f} s "
              f"(range {min(refs):.2f}-{max(refs):.2f} s)")
        for tree, cmds in out.items():
            print(f"wall (CPU) time of each command, median of {args.runs} runs, bytecode {args.bytecode} ({tree}):")
            for cmd, r in cmds.items():
                print(f"  {r['median_s']:6.2f} s ({r['median_cpu_s']:5.2f} s)  {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
