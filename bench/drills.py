"""Every scenario in drills/ on one embedded Ray cluster and one moto S3 server, as a table for
docs/benchmarks.md: the oracle, the recovery timeline, bytes by tier, lost steps and goodput.

Usage: python bench/drills.py [--all]   (--all adds the `slow: true` scenarios)
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
from orchestrator.drills.scenario import load_scenario  # noqa: E402
from planner import ClusterSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n else "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    for k, v in CREDS.items():
        os.environ.setdefault(k, v)
    ec = EmbeddedCluster(ClusterSpec.model_construct(nodes=[]))
    ec.connect()
    s3 = S3Server()
    refs: dict = {}
    print("| scenario | oracle | max rel. diff | samples once | recovery: detect / re-plan / restored / first step (s "
          "after the fault) | restored live / peer / S3 (MiB) | lost steps | failed uploads | goodput | drill s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        for path in sorted((ROOT / "drills").glob("*.yaml")):
            if path.name.startswith("job-"):
                continue
            sc = load_scenario(path)
            if sc.slow and not args.all:
                continue
            key = (sc.job.model_copy(update={"checkpoint": None, "name": ""}).model_dump_json(),
                   tuple(sorted(sc.added_nodes())))
            t0 = time.perf_counter()
            r = Drill(sc, cluster=ec, s3=s3).run(reference=refs.get(key))
            refs.setdefault(key, r.reference)
            out = r.to_json()
            t_fault = min((f["injected_s"] for f in out["faults"]), default=0.0)
            times = []
            for x in out["recoveries"]:
                parts = [x["detected_s"], x["replanned_s"], x["restored_s"], x["first_step_s"]]
                times.append(" / ".join("-" if p is None else f"{p - t_fault:.1f}" for p in parts))
            b = out["bytes_by_tier"]
            print(f"| {sc.name} | {'holds' if r.oracle_holds else 'FAILS: ' + '; '.join(r.expect_failures)} | "
                  f"{r.max_rel_diff:.1e} | {r.samples['exactly_once']} | {'; '.join(times)} | "
                  f"{_mib(b['live'])} / {_mib(b['peer'])} / {_mib(b['s3'])} | {r.lost_steps} | "
                  f"{out['failed_uploads']} | {r.goodput * 100:.0f}% | {time.perf_counter() - t0:.0f} |", flush=True)
    finally:
        s3.stop()
        ec.shutdown()


if __name__ == "__main__":
    main()
