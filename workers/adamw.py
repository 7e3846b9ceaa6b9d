"""`FusedAdamW`: torch's fused AdamW update (the kernel `torch._fused_adamw_`, called with the arguments and the
state `torch.optim.AdamW(fused=True)` gives it), without torch.optim's wrappers around it.

Why not `torch.optim.AdamW` itself: its constructor (`add_param_group`), `step`, `zero_grad` and `state_dict` are
wrapped for torch.compile, and the first call of any of them imports `torch._dynamo` (sympy and about 800
modules). hetspot never compiles, and that import was 2.0-2.1 s of CPU in every worker process, paid again in each
one the fleet starts (a joined node's workers, a warm worker, a replaced rank): measured here with torch 2.13 by
`tests/test_adamw.py`'s subprocess, which checks it is gone.

What is kept: the update is torch's own kernel, so parameters and moments are equal to torch's fused AdamW to the
bit (`tests/test_adamw.py` steps both side by side), and the state is torch's layout, per parameter:
`step` (a float32 scalar tensor on the parameter's device), `exp_avg`, `exp_avg_sq`. The engine reads and sets it
as it did torch's (`state`, `step()`, `zero_grad(set_to_none=True)`). No amsgrad, no maximize, no scaler
argument beyond torch's own `grad_scale` and `found_inf`, which the engine passes as tensors on the parameters'
device: every gradient is divided by `grad_scale` inside the kernel (the fp16 loss scale over the clip
coefficient: unscaling and global-norm clipping without a pass of their own over the gradients, and without the
host reading the norm), and a nonzero `found_inf` leaves parameters, moments and step count as they were
(workers/grad_sync.py computes both on the device).
"""

from __future__ import annotations

import torch


class FusedAdamW:
    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        self.param_groups = [{"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay} | g
                             for g in param_groups]
        for g in self.param_groups:
            g["params"] = list(g["params"])
            for p in g["params"]:
                if not (p.is_floating_point() and (p.device.type == "cpu" or p.is_cuda)):
                    raise ValueError(f"fused AdamW takes floating-point CPU or CUDA parameters, not {p.dtype} on "
                                     f"{p.device}")
        self.state: dict[torch.Tensor, dict] = {}

    @torch.no_grad()
    def step(self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        for g in self.param_groups:
            by_kind: dict[tuple, tuple[list, ...]] = {}  # torch groups its fused call by device and dtype
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state.get(p)
                if not st:
                    st = self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                          "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                          "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
                lists = by_kind.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for out, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st["step"]), strict=True):
                    out.append(t)
            beta1, beta2 = g["betas"]
            for params, grads, avgs, sqs, steps in by_kind.values():
                torch._foreach_add_(steps, 1)
                torch._fused_adamw_(params, grads, avgs, sqs, [], steps, amsgrad=False, lr=g["lr"], beta1=beta1,
                                    beta2=beta2, weight_decay=g["weight_decay"], eps=g["eps"], maximize=False,
                                    grad_scale=grad_scale, found_inf=found_inf)
                if found_inf is not None:  # a skipped step does not count (torch.optim.AdamW's fused path alike)
                    torch._foreach_sub_(steps, [found_inf] * len(steps))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
