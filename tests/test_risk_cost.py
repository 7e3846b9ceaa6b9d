"""The cost objective counts expected preemptions: $ per token trained, not per hour billed."""

from pathlib import Path

import pytest

from orchestrator.job_spec import load_job
from planner import plan

pytestmark = pytest.mark.unit
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "risk-cost.yaml"


def _used(p) -> set[str]:
    return {st.node for pipe in p.pipelines for st in pipe.stages}


def test_hot_spot_pool_loses_to_a_dearer_calm_one():
    job = load_job(EXAMPLE)
    calm = job.cluster.model_copy(update={"nodes": [n.model_copy(update={"preemptions_per_hour": 0.0})
                                                    for n in job.cluster.nodes]})
    by_price = plan(calm, job.model_spec, job.train, "cost")
    by_risk = plan(job.cluster, job.model_spec, job.train, "cost")
    assert _used(by_price) == {"t4-0", "t4-1", "t4-2", "t4-3"}  # cheapest per token on price alone
    assert _used(by_risk) == {"l4-0", "l4-1"}  # 3 preemptions per T4 node-hour tip it
    assert by_price.estimate.preemption_loss == 0.0
    assert 0 < by_risk.estimate.preemption_loss < 0.01
    assert any("cheaper per token without T4" in u.reason for u in by_risk.unused)
    # the T4 plan, charged its expected preemptions on the risky cluster, is dearer than the L4 plan
    from planner import evaluate

    t4_risky = evaluate(by_price, job.cluster, job.model_spec, job.train)
    assert t4_risky.preemption_loss > 0.15
    assert t4_risky.cost_per_mtok > by_risk.estimate.cost_per_mtok > by_price.estimate.cost_per_mtok
    # throughput ignores prices and risk: it uses every node
    assert _used(plan(job.cluster, job.model_spec, job.train)) >= {"l4-0", "t4-0"}
