"""Movement-aware re-plans: bytes moved against throughput kept, with and without the tolerance.

    python bench/replan_movement.py [--tolerance 0.02] [--json]

On each shipped fleet (examples/fleets/) and the mixed-cluster example, for the 7B and the 70B (where they
plan): the planner's plan on the whole fleet, then a loss, and the re-plan the controller makes on what is
left (control/replan.py `choose_replan`, the planner's top candidates with the running plan's surviving
pipelines among them), once choosing the soonest finish (tolerance 0) and once movement-aware (`--tolerance`,
runtime.replan_tolerance's default). Losses: a single node of each GPU type the plan uses (the first such
node), and every node of each GPU type. Per loss: throughput kept (the re-plan's predicted tokens/s over the
plan's before the loss) and the bytes every node pulls over the network together (peer and S3; what a node
holds in place is not moved). Pure: planner and cost model, no Ray. Progress on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orchestrator.control.migration import migration_bytes  # noqa: E402
from orchestrator.control.replan import TOLERANCE, choose_replan  # noqa: E402
from orchestrator.drills.trace import load_fleet  # noqa: E402
from orchestrator.job_spec import load_job  # noqa: E402
from planner import ClusterSpec, PlanningError  # noqa: E402
from planner.search import Planner  # noqa: E402
from planner.specs import ModelSpec, TrainSpec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEPS_LEFT = 10_000  # a long way to go: the soonest finish is the fastest plan unless migration is large


def fleets() -> list[tuple[str, ClusterSpec]]:
    out = [(p.stem, load_fleet(p)) for p in sorted((ROOT / "examples" / "fleets").glob("*.yaml"))]
    return out + [("mixed-cluster", load_job(ROOT / "examples" / "mixed-cluster.yaml").cluster)]


def losses(plan, cluster: ClusterSpec) -> list[tuple[str, set[str]]]:
    """(label, nodes lost): one node of each GPU type the plan uses, then every node of each such type."""
    used = set(plan.nodes())
    types = sorted({n.gpu_type for n in cluster.nodes if n.name in used})
    one = [(f"one {t} node", {min(n.name for n in cluster.nodes if n.gpu_type == t and n.name in used)})
           for t in types]
    every = [(f"every {t} node", {n.name for n in cluster.nodes if n.gpu_type == t}) for t in types
             if len(types) > 1]
    return one + every


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    train = TrainSpec(global_batch=1024)
    rows = []
    for name, cluster in fleets():
        for preset in ("7b", "70b"):
            model = ModelSpec.preset(preset)
            planner = Planner(model, train)
            try:
                old = planner.plan(cluster)
            except PlanningError as e:
                print(f"{name} {preset}: no plan ({str(e)[:80]})", file=sys.stderr)
                continue
            for label, gone in losses(old, cluster):
                left = cluster.without_nodes(gone)
                got = {}
                for tol in (0.0, args.tolerance):
                    p = planner.sharing_caches()
                    p._last_plan = old  # as the controller's planner: the running plan's surviving pipelines
                    t0 = time.perf_counter()
                    try:
                        new, _ = choose_replan(p, model, train, old, left, STEPS_LEFT, 30.0, tol)
                    except PlanningError:
                        break
                    got[tol] = {"kept": new.estimate.tokens_per_s / old.estimate.tokens_per_s,
                                "moved_gib": migration_bytes(old, new, model, train)["peer"] / 2**30,
                                "s": time.perf_counter() - t0}
                if len(got) < 2:
                    continue
                rows.append({"fleet": name, "gpus": cluster.num_gpus, "model": preset, "loss": label,
                             "soonest": got[0.0], "aware": got[args.tolerance]})
                print(f"{name} {preset} {label}: done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"tolerance": args.tolerance, "rows": rows}, indent=2))
        return
    print(f"| fleet | model | loss | soonest finish: kept | moved GiB | within {args.tolerance:.0%}: kept | moved GiB "
          "| fewer bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["soonest"], r["aware"]
        fewer = "-" if abs(a["moved_gib"] - b["moved_gib"]) < 1e-9 else (
            f"{a['moved_gib'] / b['moved_gib']:.1f}x" if b["moved_gib"] > 0 else "all")
        print(f"| {r['fleet']} ({r['gpus']} GPUs) | {r['model']} | {r['loss']} | {a['kept']:.3f} | "
              f"{a['moved_gib']:,.1f} | {b['kept']:.3f} | {b['moved_gib']:,.1f} | {fewer} |")
    changed = [r for r in rows if abs(r["soonest"]["moved_gib"] - r["aware"]["moved_gib"]) > 1e-9]
    print(f"\n{len(changed)} of {len(rows)} losses re-plan differently within the tolerance; there the movement-aware "
          f"plan keeps {min((r['aware']['kept'] / r['soonest']['kept'] for r in changed), default=1):.3f} or more of "
          "the soonest plan's throughput")


if __name__ == "__main__":
    main()
