"""The replayed-plans reference: the drill's own plans, step for step, without faults.

A fixed-plan reference (runner.py `Drill.reference`) holds the drill to the training of the plan it started
with. Over a long drill that asks for more than recovery. Two plans sum a step's gradients in different
orders (micro-batches, replicas, the ring all-reduce), so their results differ at round-off, 1e-16 relative in
float64. Training at a high learning rate near a low loss amplifies such a difference about tenfold every ten
steps. On the trace job (trace.py TRACE_JOB), the same plan run as one micro-batch and as four differs by
2e-16 at step 0, 1e-11 at step 50, 9e-6 at step 100 and 0.2 at step 140, with no fault at all.

So a trace replay, whose plans change at every event, is held to a run of the same plans. Each step runs
under the plan the drill committed it with (the last commit counts when a restore redid it). The state moves
between plans by export and import, with no fault. A recovery (restores from survivors, peers and S3, redone
steps, the data position) must then leave the training bit for bit as that run. The planner's own claim,
that any plan trains like the 1-device run, is tested with the fixed reference (tests/test_train_ray.py,
the scenario drills).
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.control.replan import node_kind, renamed
from orchestrator.errors import ConfigError
from orchestrator.job_spec import JobSpec
from planner import NodeSpec, Plan


def plan_segments(plans: dict[int, Plan], steps: int) -> list[tuple[int, int, Plan]]:
    """[(first step, end step, plan)]: the longest runs of steps committed under one layout."""
    missing = [s for s in range(steps) if s not in plans]
    if missing:
        raise ValueError(f"no plan recorded for step(s) {missing[:5]}")
    out: list[tuple[int, int, Plan]] = []
    for s in range(steps):
        p = plans[s]
        if out and _layout(out[-1][2]) == _layout(p):
            out[-1] = (out[-1][0], s + 1, out[-1][2])
        else:
            out.append((s, s + 1, p))
    return out


def _layout(p: Plan) -> str:
    return p.model_dump_json(exclude={"estimate", "unused"})


def place(plans: list[Plan], declared: list[NodeSpec], alive: list[str]) -> tuple[list[NodeSpec], list[Plan]]:
    """Each plan renamed onto nodes up now, of the same kind as the ones it named (a node that went is
    replaced by a like one: the reduction order depends on ranks, not on hosts), and the nodes to add
    where too few of a kind are up."""
    spec = {n.name: n for n in declared}
    unknown = sorted({n for p in plans for n in p.nodes()} - set(spec))
    if unknown:
        raise ConfigError(f"the plans name node(s) {', '.join(unknown)} that the job does not declare")
    pool: dict[str, list[str]] = {}
    for name in alive:
        pool.setdefault(node_kind(spec[name]), []).append(name)
    added: list[NodeSpec] = []
    out: list[Plan] = []
    for p in plans:
        used = p.nodes()
        rename: dict[str, str] = {}
        for kind in sorted({node_kind(spec[n]) for n in used}):
            mine = [n for n in used if node_kind(spec[n]) == kind]
            have = pool.setdefault(kind, [])
            while len(have) < len(mine):  # a like node, named apart from every declared one
                k = len(added)
                while f"ref{k}" in spec:
                    k += 1
                added.append(spec[mine[0]].model_copy(update={"name": f"ref{k}", "instance_id": None}))
                spec[added[-1].name] = added[-1]
                have.append(added[-1].name)
            free = [n for n in have if n not in mine]
            for n in mine:
                if n not in have:
                    rename[n] = free.pop(0)
        out.append(renamed(p.model_copy(update={"unused": []}), rename) if rename else p)
    return added, out


def replay(job: JobSpec, segments: list[tuple[int, int, Plan]],
           say: Callable[[str], None] = lambda m: None) -> tuple[list[float], dict[int, list]]:
    """Losses and samples per step of the segments' plans run one after another, the state handed on by
    export and import (no fault, no tier)."""
    from orchestrator.runtime.plan_run import PlanRun
    from workers.state import full_state

    losses: list[float] = []
    samples: dict[int, list] = {}
    state = None
    for i, (first, end, plan) in enumerate(segments):
        say(f"reference: steps {first}-{end - 1} on plan {i + 1} of {len(segments)} ({len(plan.devices())} GPUs)")
        run = PlanRun(job, plan)
        try:
            run.start()
            if state is not None:
                run.import_state(*state)
            r = run.run(end - first, first_step=first)
            losses += r.losses
            samples.update({first + k: v for k, v in enumerate(r.samples)})
            state = full_state(run.export_states()) if i + 1 < len(segments) else None
        finally:
            run.shutdown()
    return losses, samples
