"""The plan contract: every condition the runtime relies on, checked in one place.

The planner only emits plans that pass it, `hetspot submit --plan` refuses a
plan that does not (exit 2, before any actor starts), and every worker checks
its plan again before it builds its stage, so no path can train a plan the
runtime does not support.

Tensor parallelism (workers/model.py, Megatron-LM): q, k, v and the MLP's first
linear are split on output rows by whole heads, the attention output and the
MLP's second linear on input columns. So a TP degree t needs `num_heads % t == 0`
(whole heads per rank; `hidden_size % t` follows) and `ffn % t == 0`. The token
embedding and the LM head are split by vocabulary rows in chunks of ceil(vocab / t)
(Megatron-LM's vocabulary-parallel embedding, head and cross-entropy), so
`vocab_size` needs no divisibility, only a row for every rank. The Llama (workers/llama.py) splits k and v by whole
key/value heads too, so it also needs `num_kv_heads % t == 0`. A degree that
breaks these would silently drop rows of a weight: a different model.
"""

from __future__ import annotations

from planner.catalog import canonical_gpu_type
from planner.plan_types import Plan
from planner.specs import ClusterSpec, ModelSpec, TrainSpec


class PlanContractError(ValueError):
    """A plan the runtime cannot train as the 1-device model; the message lists every problem."""


def tp_problem(model: ModelSpec, tp: int) -> str | None:
    """Why TP degree `tp` cannot shard `model`, or None if it can."""
    bad = []
    if model.num_heads % tp:
        bad.append(f"num_heads={model.num_heads}")
    if model.ffn % tp:
        bad.append(f"ffn_size={model.ffn}")
    if model.kv_heads % tp and model.arch == "llama":
        bad.append(f"num_kv_heads={model.kv_heads}")
    if model.vocab_size < -(-model.vocab_size // tp) * (tp - 1) + 1:  # a rank would hold no vocabulary row
        bad.append(f"vocab_size={model.vocab_size}")
    if not bad:
        return None
    why = "whole heads and MLP rows" + (", and a vocabulary row" if any("vocab" in b for b in bad) else "")
    return f"TP degree {tp}, which does not divide {' and '.join(bad)} (a TP rank must hold {why})"


def runtime_problems(plan: Plan, model: ModelSpec) -> list[str]:
    """What breaks the runtime's contract: structure, layer coverage and TP divisibility."""
    problems = []
    if plan.num_layers != model.num_layers:
        problems.append(f"plan has num_layers={plan.num_layers} but the model has {model.num_layers}")
    try:
        plan.check_structure()
    except ValueError as e:
        problems.append(str(e))
    for r, p in enumerate(plan.pipelines):
        for i, st in enumerate(p.stages):
            why = tp_problem(model, st.tp)
            if why:
                problems.append(f"pipeline {r} stage {i} on {st.node} has {why}")
    return list(dict.fromkeys(problems))


def check_runtime_plan(plan: Plan, model: ModelSpec) -> None:
    """Raise PlanContractError if the runtime cannot train `plan` as the 1-device model."""
    problems = runtime_problems(plan, model)
    if problems:
        raise PlanContractError("; ".join(problems))


def plan_problems(plan: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> list[str]:
    """The runtime's problems plus the job's: batch, devices, nodes and GPU types (aliases allowed)."""
    problems = runtime_problems(plan, model)
    if plan.global_batch != train.global_batch:
        problems.append(f"plan global_batch={plan.global_batch} but train.global_batch={train.global_batch}")
    if len(plan.pipelines) > train.global_batch:
        problems.append(f"global batch {train.global_batch} is smaller than the plan's {len(plan.pipelines)} pipelines")
    known = {d: n for n in cluster.nodes for d in n.device_ids()}
    for p in plan.pipelines:
        for st in p.stages:
            try:
                stage_type = canonical_gpu_type(st.gpu_type)
            except ValueError as e:
                problems.append(f"stage on {st.node}: {e}")
                continue
            for d in st.devices:
                node = known.get(d)
                if node is None:
                    problems.append(f"device {d} is not in the job's cluster (it has {len(known)} GPUs)")
                elif node.gpu_type != stage_type:
                    problems.append(f"device {d} is a {node.gpu_type}, the plan says {st.gpu_type}")
    return list(dict.fromkeys(problems))
