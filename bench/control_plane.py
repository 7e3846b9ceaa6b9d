"""The control plane at fleet scale: one node lost from a job of 1,024 / 4,096 / 16,384 ranks, from the failure
to every rank holding its new assignment and its state, without Ray or a torch step.

    python bench/control_plane.py [--sizes 1024 4096 16384] [--trials 5]

The real pieces, in one process: the failure policy (orchestrator/control/failure.py), the survivors keeping
their committed step in place (TieredState.salvage over `LocalGroup`'s in-process worker stand-ins and
`LocalCalls`' keepers), the re-plan the controller makes (control/replan.py `choose_replan`: the planner's top
candidates, warm caches, weighed with what moving onto each costs), the new group's ranks taking the kept
processes on their nodes (state/recovery.take_kept), and the restore (TieredState.restore: the restore planner
over every unit slice, the fetches per rank, and each rank's loads). The model is the 175B preset on nodes of 8
GPUs of six types, round robin (bench/planner.py's warm re-plan set-up); the stand-in workers hold tiny arrays per
unit, so the bytes are not the point: the work per rank is.

Printed per size: CPU seconds (time.process_time) per phase of the controller, the garbage collector paused from
the failure to the restore as the controller pauses it (planner.search.CollectionPause; `--collect` leaves it
on), medians of `--trials` kills of a node in the middle of the list, each on a fresh job with the
planner's caches warm from planning it. The controller's columns leave out what the ranks and keepers do on their
own side (in a job each runs in its own process, in parallel: the ranks' loads, the keepers' inventories and the
kept processes' rows, each answer pickled; the controller's unpickling stays in): that is the next column. Last,
the growth from the smallest size. These machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from orchestrator.control.failure import Replan, failure_policy  # noqa: E402
from orchestrator.control.replan import choose_replan  # noqa: E402
from orchestrator.errors import FailureKind, WorkerFailure  # noqa: E402
from orchestrator.state import fakes  # noqa: E402
from orchestrator.state.calls import LocalCalls  # noqa: E402
from orchestrator.state.fakes import LocalGroup, LocalPool, model_units  # noqa: E402
from orchestrator.state.keeper import KeeperStore  # noqa: E402
from orchestrator.state.recovery import InPlace  # noqa: E402
from orchestrator.state.tiers import TieredState  # noqa: E402
from planner import ClusterSpec, NodeSpec, layout  # noqa: E402
from planner.search import CollectionPause, Planner  # noqa: E402
from planner.specs import ModelSpec, TrainSpec  # noqa: E402

TYPES = ["H100-SXM", "A100-80GB", "A100-40GB", "L40S", "A10G", "L4"]
PHASES = ("decide", "salvage", "re-plan", "assign", "restore")  # the controller's side; the loads are the workers'


class TimedGroup(LocalGroup):
    """`LocalGroup` whose ranks' loads (the workers' side of a restore: in a job each rank loads in its own process,
    in parallel) are timed apart from the controller's restore planning and dispatch."""

    loads_s = 0.0

    def load(self, *args, **kwargs):
        t0 = time.process_time()
        try:
            return super().load(*args, **kwargs)
        finally:
            self.loads_s += time.process_time() - t0
class Remote:
    """CPU spent answering the controller on the other side of a call: in a job the keepers' inventories and the
    kept processes' rows are made on their own nodes, in parallel; here they run in this process, so their share
    is timed apart. The answer still crosses as a pickle, and the controller's side of that (unpickling, as
    Ray's `get` does) stays in its phase."""

    s = 0.0


def _answered_remotely(fn):
    def call(self, *args, **kwargs):
        t0 = time.process_time()
        data = pickle.dumps(fn(self, *args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        Remote.s += time.process_time() - t0
        return pickle.loads(data)

    return call


KeeperStore.inventory = _answered_remotely(KeeperStore.inventory)  # type: ignore[method-assign]
fakes.LocalProcess.held = _answered_remotely(fakes.LocalProcess.held)  # type: ignore[method-assign]
fakes.SHAPE = (24, 3)  # each stand-in unit: rows every TP degree the planner picks here (1-8) divides


def cluster_of(gpus: int) -> ClusterSpec:
    return ClusterSpec(nodes=[NodeSpec(name=f"n{i:04d}", gpu_type=TYPES[i % len(TYPES)], num_gpus=8)
                              for i in range(gpus // 8)])


def trial(planner: Planner, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan, lost: str,
          paused: bool = True) -> dict:
    """One node loss on a fresh job at step 0: CPU seconds per phase, and what the recovery did."""
    calls = LocalCalls([n.name for n in cluster.nodes])
    store = TieredState(1, calls=calls, model_units=model_units(model.num_layers))
    mode = InPlace(LocalPool())  # the job's one recovery strategy, its pool kept across the two groups
    group = LocalGroup(plan, calls, mode)
    group.commit(0)
    store.after_step(group, 0)
    calls.kill(lost)
    gc.collect()
    out: dict = {}

    def timed(name, fn):
        t0, w0, r0 = time.process_time(), time.perf_counter(), Remote.s
        got = fn()
        out[name] = time.process_time() - t0 - (Remote.s - r0)
        out["remote"] = out.get("remote", 0.0) + Remote.s - r0
        out["wall"] = out.get("wall", 0.0) + time.perf_counter() - w0
        return got

    failure = WorkerFailure(f"rank 0 (node {lost})", "node lost", FailureKind.NODE_LOST, [lost])
    decision = timed("decide", lambda: failure_policy(failure, 0, 100))
    assert isinstance(decision, Replan), decision
    collection = CollectionPause()  # as the controller: no automatic collection from the failure to the restore
    if paused:
        collection.pause()
    timed("salvage", lambda: (store.salvage(group, {lost}, 0), group.release()))  # the controller's two calls
    survivors = cluster.without_nodes({lost})
    new_plan, _ = timed("re-plan", lambda: choose_replan(planner, model, train, plan, survivors, 1000, 5.0))
    new = timed("assign", lambda: TimedGroup(new_plan, calls, mode))
    report = timed("restore", lambda: store.restore(new, {lost}))
    collection.resume()
    out["restore"] -= new.loads_s
    out["loads"] = new.loads_s + out["remote"]
    assert report is not None and report.step == 0 and new.step == 0, report
    out["ranks"], out["new ranks"] = len(layout.ranks(plan)), len(layout.ranks(new_plan))
    out["kept"] = sum(new.kept)
    out["needs"] = sum(len(units) for units in new.units)  # (rank, unit) pairs the restore planned
    out["tiers"] = {str(t): n for t, n in report.bytes_by_tier.items() if n}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--collect", action="store_true", help="leave the garbage collector on over the recovery (the "
                    "controller pauses it: planner.search.CollectionPause)")
    args = ap.parse_args()
    model, train = ModelSpec.preset("175b"), TrainSpec(global_batch=2048)
    print("| ranks (GPUs) | ranks after | kept in place | (rank, unit) needs | "
          + " | ".join(f"{p} CPU s" for p in PHASES)
          + " | total CPU s | ranks' and keepers' own CPU s | wall s | trials |")
    print("|---" * (len(PHASES) + 8) + "|")
    rows = {}
    for gpus in args.sizes:
        cluster = cluster_of(gpus)
        planner = Planner(model, train)
        plan = planner.plan(cluster)
        lost = plan.pipelines[len(plan.pipelines) // 2].stages[0].node  # a node the plan uses
        trials = []
        for _ in range(args.trials):
            trials.append(trial(planner, model, train, cluster, plan, lost, paused=not args.collect))
        med = {p: statistics.median(t[p] for t in trials) for p in PHASES}
        total = statistics.median(sum(t[p] for p in PHASES) for t in trials)
        last = trials[-1]
        rows[gpus] = (total, last["ranks"])
        print(f"| {last['ranks']:,} ({gpus:,}) | {last['new ranks']:,} | {last['kept']:,} | {last['needs']:,} | "
              + " | ".join(f"{med[p]:.3f}" for p in PHASES)
              + f" | {total:.3f} | {statistics.median(t['loads'] for t in trials):.3f} | "
              f"{statistics.median(t['wall'] for t in trials):.2f} | {len(trials)} |", flush=True)
    first = min(rows)
    for gpus, (total, ranks) in rows.items():
        if gpus != first:
            print(f"growth {first:,} -> {gpus:,} GPUs: x{total / rows[first][0]:.2f} CPU for "
                  f"x{ranks / rows[first][1]:.2f} ranks")


if __name__ == "__main__":
    main()
