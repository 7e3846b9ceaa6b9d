"""The path a node loss takes through the controller's process, counted: from the kill to the first step committed
after it, which of the project's modules run and how many hand-offs there are between them.

    python bench/recovery_path.py [--recovery in-place] [--tree DIR] [-v]

One in-place (or restart) kill trial of bench/recovery.py on the local Ray test cluster: two data-parallel replicas,
the H100 node that holds one of them is removed after step 2, and the controller recovers on the L4 that stays. From
the kill until the first new step is committed, every call the controller's thread makes is traced
(`sys.setprofile`); the count keeps the calls from a function of one of the project's files (orchestrator/,
planner/, workers/) into a function of another. A module is a project file one of those calls enters or leaves; a
hand-off is one (caller file, callee file) pair, counted once however often it is taken. What runs in the workers,
in the keepers and on other threads (uploads, the answers a failure leaves unread) is not counted: it is the
controller's own walk. It is counted three ways: file by file; with the planner as one module (planner/ is a
package of its own that the orchestrator enters through its API, `Planner` and the plan's types; how its search
is split inside is the planner's concern, not the recovery path's), the count the walk is held to; and the
orchestrator's own, the calls between two of its files. `--tree DIR` counts another tree's code
(another commit's worktree, as in `git worktree add /tmp/old REV`) with the same trial, for a before and after.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv[:-1] else None
sys.path[0] = _TREE or str(Path(__file__).resolve().parents[1])
ROOT = Path(sys.path[0]).resolve()
PACKAGES = ("orchestrator", "planner", "workers")


def project_file(filename: str) -> str | None:
    """The file's path in the tree, where it is one of the project's modules."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in PACKAGES else None


class Walk:
    """Cross-module calls on the tracing thread: which modules, which (caller, callee) pairs, how often each."""

    def __init__(self) -> None:
        self.handoffs: Counter[tuple[str, str]] = Counter()
        self._files: dict[str, str | None] = {}

    def _file(self, code) -> str | None:
        name = code.co_filename
        if name not in self._files:
            self._files[name] = project_file(name)
        return self._files[name]

    def __call__(self, frame, event: str, arg) -> None:
        if event != "call" or frame.f_back is None:
            return
        callee, caller = self._file(frame.f_code), self._file(frame.f_back.f_code)
        if callee and caller and callee != caller:
            self.handoffs[(caller, callee)] += 1

    @property
    def modules(self) -> set[str]:
        return {f for pair in self.handoffs for f in pair}

    def within(self, package: str) -> Walk:
        """The same walk with only the calls between two files of `package`."""
        out = Walk()
        out.handoffs.update({pair: n for pair, n in self.handoffs.items()
                             if all(f.startswith(package + "/") for f in pair)})
        return out

    def whole(self, package: str) -> Walk:
        """The same walk with every file of `package` counted as one module (calls inside it are not hand-offs)."""
        out = Walk()
        for (a, b), n in self.handoffs.items():
            a, b = (package if f.startswith(package + "/") else f for f in (a, b))
            if a != b:
                out.handoffs[(a, b)] += n
        return out


def trial(recovery: str) -> Walk:
    import time

    import ray

    from bench.recovery import STAY, dp_plan, job, until
    from orchestrator.cluster.embedded import EmbeddedCluster
    from orchestrator.control.controller import State
    from orchestrator.runtime.controller_actor import make_controller
    from planner import ClusterSpec, NodeSpec

    ec = EmbeddedCluster(ClusterSpec(nodes=[STAY]))
    ec.connect()
    try:
        doomed = NodeSpec(name="h100-walk", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
        ec.nodes[doomed.name] = ec.add(doomed)
        j = job(doomed, recovery=recovery)
        j = j.model_copy(update={"cluster": ClusterSpec(nodes=[doomed, STAY.model_copy(update={"num_gpus": 1})])})
        c = make_controller(j, steps=100, first_plan=dp_plan(j, [doomed.name, STAY.name]))
        until(c, lambda c: c.progress.committed >= 2)
        committed = c.progress.committed
        ray.get(c.store._receipts[-1][1], timeout=60)  # the newest snapshot's peer copies are in
        walk = Walk()
        t0 = time.perf_counter()
        sys.setprofile(walk)
        try:
            ec.remove(doomed.name)
            until(c, lambda c: c.progress.committed > committed)
        finally:
            sys.setprofile(None)
        took = time.perf_counter() - t0
        assert any(e["kind"] == "re-plan" for e in c.progress.events), "the kill was not seen as a failure"
        assert c.state is State.TRAINING
        print(f"kill -> first new step: {took:.2f} s (traced; the trace slows it)")
        c.group.shutdown()
        return walk
    finally:
        ec.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recovery", default="in-place", choices=["in-place", "restart"])
    ap.add_argument("--tree", metavar="DIR", help="count another tree's code (a worktree of another commit)")
    ap.add_argument("-v", action="store_true", help="list the modules and the hand-offs, with their call counts")
    args = ap.parse_args()
    from bench.quiet import quiet

    quiet(False)
    walk = trial(args.recovery)
    print(f"tree {ROOT}, recovery {args.recovery}: node lost -> first step crosses {len(walk.modules)} modules "
          f"and {len(walk.handoffs)} hand-offs ({sum(walk.handoffs.values())} cross-module calls)")
    one = walk.whole("planner")
    print(f"  with planner/ as one module: {len(one.modules)} modules and {len(one.handoffs)} hand-offs")
    own = walk.within("orchestrator")
    print(f"  the orchestrator's own (calls between its files): {len(own.modules)} modules and "
          f"{len(own.handoffs)} hand-offs")
    if args.v:
        for m in sorted(walk.modules):
            print("  module", m)
        for (a, b), n in sorted(walk.handoffs.items()):
            print(f"  {a} -> {b}: {n}")


if __name__ == "__main__":
    main()
