"""Every scenario in drills/ on one embedded Ray cluster and one moto S3 server, as a table for
docs/benchmarks.md: the oracle, the recovery timeline, bytes by tier, lost steps and goodput.

Usage: python bench/drills.py [--all] [--recovery in-place|restart|both] [--only NAME ...] [--repeat N]
(--all adds the `slow: true` scenarios; both: each scenario on each recovery path, one run; --repeat N: each
scenario N times on each path, the gap table then gives each path's median run)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.drills.inject import S3Server  # noqa: E402
from orchestrator.drills.runner import CREDS, Drill  # noqa: E402
from orchestrator.drills.scenario import Expect, load_scenario, scenario_files  # noqa: E402
from planner import ClusterSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n else "0"


def _timeline(out: dict) -> tuple[str, list[float]]:
    """The recoveries' detect / re-plan / restored / first step, in seconds after the scenario's first fault; and
    per recovery, detect to first step (for a drain, the training stall at its switch instead)."""
    t_fault = min((f["injected_s"] for f in out["faults"]), default=0.0)
    times, gaps = [], []
    for x in out["recoveries"]:
        parts = [x["detected_s"], x["replanned_s"], x["restored_s"], x["first_step_s"]]
        times.append(" / ".join("-" if p is None else f"{p - t_fault:.1f}" for p in parts))
        if x.get("stall_s") is not None:  # a drain: training stops at its switch, not at the notice
            gaps.append(x["stall_s"])
        elif x["first_step_s"] is not None:
            gaps.append(x["first_step_s"] - x["detected_s"])
    return "; ".join(times), gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--recovery", default="in-place", help="in-place, restart, or both (each scenario on each path, "
                    "alternating, then a table of detect-to-first-step per path)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these scenarios (by name, e.g. add-node)")
    ap.add_argument("--repeat", type=int, default=1, help="run each scenario this many times (medians of its gaps)")
    args = ap.parse_args()
    paths = ["in-place", "restart"] if args.recovery == "both" else [args.recovery]
    for k, v in CREDS.items():
        os.environ.setdefault(k, v)
    ec = EmbeddedCluster(ClusterSpec.model_construct(nodes=[]))
    ec.connect()
    s3 = S3Server()
    refs: dict = {}
    gaps: dict = {}
    print("| scenario | recovery | oracle | max rel. diff | samples once "
          "| recovery: detect / re-plan / restored / first "
          "step (s after the fault) | restored in place / live / peer / S3 (MiB) | lost steps | failed uploads "
          "| goodput | drill s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for path in scenario_files(ROOT / "drills"):
            sc = load_scenario(path)
            if (sc.slow and not args.all) or (args.only and sc.name not in args.only):
                continue
            key = (sc.job.model_copy(update={"checkpoint": None, "name": ""}).model_dump_json(),
                   tuple(sorted(sc.added_nodes())))
            for recovery in [p for _ in range(args.repeat) for p in paths]:
                job = sc.job.model_copy(update={"runtime": sc.job.runtime.model_copy(update={"recovery": recovery})})
                if recovery != "in-place" and job.checkpoint is not None:  # its own S3 prefix: no resume of the
                    job = job.model_copy(update={"checkpoint": job.checkpoint.model_copy(  # other path's steps
                        update={"uri": f"{job.checkpoint.uri}-{recovery}"})})
                # the scenarios' byte expectations are the default path's: the other is held to the oracle alone
                run = sc.model_copy(update={"job": job} | ({} if recovery == "in-place" else {
                    "expect": Expect(), "name": f"{sc.name}-{recovery}"}))
                t0 = time.perf_counter()
                r = Drill(run, cluster=ec, s3=s3).run(reference=refs.get(key))
                refs.setdefault(key, r.reference)
                out = r.to_json()
                times, g = _timeline(out)
                gaps.setdefault(sc.name, {}).setdefault(recovery, []).append(g)
                if r.error:
                    print(f"{sc.name} ({recovery}): {r.error}", flush=True)
                b = out["bytes_by_tier"]
                oracle = "holds" if r.oracle_holds else "FAILS: " + "; ".join(r.expect_failures)
                print(f"| {sc.name} | {recovery} | {oracle}"
                      f" | {r.max_rel_diff:.1e} | {r.samples['exactly_once']} | {times} | "
                      f"{_mib(b['in_place'])} / {_mib(b['live'])} / {_mib(b['peer'])} / {_mib(b['s3'])} "
                      f"| {r.lost_steps} | {out['failed_uploads']} | {r.goodput * 100:.0f}% "
                      f"| {time.perf_counter() - t0:.0f} |", flush=True)
    finally:
        s3.stop()
        ec.shutdown()
    if len(paths) == 2:
        print("\n| scenario | detect -> first step, in place (s) | restart (s) | restart / in place |")
        print("|---|---|---|---|")
        for name, runs in gaps.items():  # per path, the median run's gaps (by their sum) over --repeat runs
            g = {p: sorted(runs[p], key=sum)[len(runs[p]) // 2] for p in paths}
            a, b = sum(g["in-place"]), sum(g["restart"])
            print(f"| {name} | {' + '.join(f'{x:.2f}' for x in g['in-place']) or '-'} "
                  f"| {' + '.join(f'{x:.2f}' for x in g['restart']) or '-'} | {b / a:.1f}x |" if a else
                  f"| {name} | - | - | - |")
        if args.repeat > 1:
            print(f"(each path's median of {args.repeat} runs, by the sum of its recoveries' gaps)")
        print("(a drain counts its training stall at the switch, not the time from its notice)")


if __name__ == "__main__":
    main()
