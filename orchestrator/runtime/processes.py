"""The worker processes of an in-place job between plans, on Ray: `WorkerPool`, state/processes.Pool over
runtime/plan_run.Kept (a TrainWorker actor and its one-GPU placement group).

The pool's logic (which process a rank takes, how many warm workers a node still needs, which ones a changed
cluster ends) is state/processes.Pool's, shared with the in-process fake (state/fakes.LocalPool); this module adds
only how a warm worker starts on a GPU of a node, how it ends, and whether every warm worker has started.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

import ray

from orchestrator.job_spec import JobSpec
from orchestrator.runtime.plan_run import Kept, gpu_placement, new_worker, torch_threads
from orchestrator.state.processes import Pool


class WorkerPool(Pool[Kept]):
    """Worker processes between plans (AutoHet's local-first recovery taken to the process): survivors of a
    failure, a drain or a move, each keeping its committed state, and warm workers started ahead of need."""

    def __init__(self, job: JobSpec) -> None:
        super().__init__()
        self.job = job

    def _alive(self, nodes: Set[str]) -> Mapping[str, Any]:
        from orchestrator.cluster.discovery import RayInventory

        return {d.name: d for d in RayInventory().discover() if d.name in nodes}

    def _start(self, node: str, info: Any) -> Kept:
        """A worker on one GPU of `node` that joins no group yet (TrainWorker with no plan): its process, imports
        and device context are ready when a plan's rank takes it."""
        pg = gpu_placement(info.node_id)
        actor = new_worker(self.job, pg, None, -1, 1.0, torch_threads(self.job, info))
        return Kept(actor, pg, node, (0, 0), 0, -1, actor.ready.remote())

    def warm_ready(self) -> bool:
        refs = [k.ready for k in self.warm]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0) if refs else ([], [])
        return len(done) == len(refs)
