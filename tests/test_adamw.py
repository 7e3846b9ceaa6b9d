"""hetspot's AdamW (workers/adamw.py): torch's fused AdamW to the bit, and a worker's training step that never
imports torch._dynamo (torch.optim's wrappers did: 2 s of CPU in every worker process)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.adamw import FusedAdamW

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((16, 8), (8,), (3, 5, 2), (1,))]


def test_fused_adamw_equals_torchs_fused_adamw_to_the_bit():
    ours, theirs = _params(0), _params(0)

    def groups(ps):  # as the engine groups them: decay on matrices, none on vectors
        return [{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}]

    a = FusedAdamW(groups(ours), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    b = torch.optim.AdamW(groups(theirs), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
            if step == 2 and i == 1:  # a parameter without a gradient this step is left as it is, as torch does
                p.grad = q.grad = None
                continue
            grad = torch.randn(p.shape, generator=g) * 10 ** (i - 2)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        b.step()
        a.zero_grad(set_to_none=True)
        b.zero_grad(set_to_none=True)
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert p.grad is None
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert a.state[p][k].dtype == b.state[q][k].dtype and torch.equal(a.state[p][k], b.state[q][k]), k
    assert float(a.state[ours[0]]["step"]) == 6 and float(a.state[ours[1]]["step"]) == 5


def test_state_set_from_outside_continues_as_torchs_does():
    """A restore sets a parameter's state (workers/state.py puts `step` as a float32 tensor on its device): the
    next update continues from it exactly as torch's optimizer given the same state does."""
    (p,), (q,) = _params(2)[:1], _params(2)[:1]
    st = {"step": torch.tensor(7.0), "exp_avg": torch.full_like(p, 0.01), "exp_avg_sq": torch.full_like(p, 1e-4)}
    a = FusedAdamW([{"params": [p]}], lr=1e-3)
    b = torch.optim.AdamW([q], lr=1e-3, fused=True)
    a.state[p] = {k: v.clone() for k, v in st.items()}
    b.state[q] = {k: v.clone() for k, v in st.items()}
    p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
    a.step()
    b.step()
    assert torch.equal(p, q) and torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])


def test_a_non_float_parameter_is_refused_by_name():
    with pytest.raises(ValueError, match="floating-point"):
        FusedAdamW([{"params": [torch.zeros(2, dtype=torch.int64)]}], lr=1e-3)


def test_an_engines_steps_never_import_torch_dynamo():
    """In a fresh interpreter: one rank's Engine (gloo, world size 1) trains 2 steps and its state is read, and
    `torch._dynamo` is not in sys.modules. With torch.optim.AdamW back in workers/optim_state.py this fails."""
    code = textwrap.dedent("""
        import sys
        from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
        from workers.data import make_dataset
        from workers.engine import Engine
        import torch
        m = ModelSpec.preset("tiny")
        st = Stage(layer_start=0, layer_end=m.num_layers, gpu_type="L4", node="a", devices=["a/0"])
        plan = Plan(model_name=m.name, num_layers=m.num_layers, global_batch=4,
                    pipelines=[Pipeline(num_samples=4, micro_batch_size=2, num_micro_batches=2, stages=[st])])
        e = Engine(plan, 0, m, TrainSpec(global_batch=4), make_dataset("synthetic", m.seq_len, m.vocab_size, 0),
                   torch.float32)
        e.connect_alone(30)
        try:
            losses = [e.step(s) for s in range(2)]
            e.settle()
            assert all(float(st["step"]) == 2 for st in e.optimizer_states())
        finally:
            e.close()
        assert "torch._dynamo" not in sys.modules, "the optimizer imported torch._dynamo"
        print("ok", len(losses))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok 2" in r.stdout, r.stdout + r.stderr
