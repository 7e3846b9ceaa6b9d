"""The optimizer side of one rank's Engine (workers/engine.py), apart from its step loop, as torchtitan keeps
it: AdamW (torch's fused kernel, workers/adamw.py), the fp32 masters and where they live (on the device, or on
the host under optimizer offload, with gradients streamed there and a per-layer host update: AutoHete), the
update itself, the bytes of state on each side, and per-parameter optimizer state for workers/state.py. A mixin
of `Engine`.
"""

from __future__ import annotations

import contextlib

import torch

from workers.adamw import FusedAdamW
from workers.copy_lane import Ticket
from workers.engine_parts import EngineParts


class OptimizerState(EngineParts):
    def _adamw(self, params: list) -> FusedAdamW:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return FusedAdamW([g for g in groups if g["params"]], lr=self.train.lr, betas=self.train.betas,
                          eps=self.train.eps)

    def _copy_back(self, layer: int) -> Ticket | None:
        """After a layer's host update (on the cpu lane): its resident device copies take the new weights, on the
        h2d lane: the layer's fp32 masters in one copy, cast on the device. The ticket the layer's next use waits
        on; None where the layer has no resident copy (its weights are fetched)."""
        names = self.resident_by_layer.get(layer)
        if not names:
            return None
        assert self.host is not None and self.lanes is not None  # (optimizer offload)
        lanes, offset = self.lanes, {n: a for n, a, *_ in self.host.spans[layer]}
        pieces = [(offset[n], self.resident[n].detach().view(-1)) for n in names]
        src = self.host.masters[layer]

        def job() -> None:
            with torch.no_grad():
                lanes.upload(src, pieces)

        return lanes.h2d.submit(job)

    def _to_stream(self, name: str):
        """A resident parameter's gradient, handed to the gradient stream as backward accumulates it."""
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None and self.grads is not None  # (a post-accumulate-grad hook, offload)
            g, p.grad = p.grad, None
            self.grads.deliver(name, g)

        return hook

    def _grad_to_master(self, master: torch.nn.Parameter):
        pause = self.meter.paused if self.offload_opt else contextlib.nullcontext  # host bytes are not the device's

        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None  # (a post-accumulate-grad hook: the gradient is there)
            with pause():
                g = p.grad if p.grad.device == master.device else p.grad.to(master.device)  # D2H in compute dtype
                if master.grad is None:
                    master.grad = g.to(master.dtype, copy=True)
                else:
                    master.grad.add_(g)
            p.grad = None

        return hook

    @property
    def grad_params(self) -> dict[str, torch.nn.Parameter]:
        """The parameters whose `.grad` holds the step's gradient: host masters under offload."""
        return self.opt_params if self.separate else self.module.params

    def _update(self) -> None:
        if self.updater is not None:  # host AdamW per layer on a thread; the next forward waits per layer
            self.updater.start(self._host_scale, self._host_inf)
            return
        # Unscaling, clipping and an fp16 overflow's skip happen inside the fused kernel, from device tensors
        # (GradSync `_scales`): no pass over the gradients and no host read.
        self.adamw.step(self._grad_scale, self._found_inf)
        self.adamw.zero_grad(set_to_none=True)
        if self.mixed:  # the compute copies take the new master weights, in one foreach copy
            with torch.no_grad():
                names = list(self.module.params)
                torch._foreach_copy_([self.module.params[n] for n in names], [self.opt_params[n] for n in names])
        if self.meter.enabled and not self._moments_counted:
            self._moments_counted = True
            self.meter.set_static(self._device_state() + [t for st in self.adamw.state.values()
                                                          for t in st.values() if torch.is_tensor(t) and t.dim() > 0])

    def _device_state(self) -> list[torch.nn.Parameter]:
        """Tensors that stay on the device between steps: the compute copies, and fp32 masters when mixed."""
        masters = list(self.opt_params.values()) if self.mixed and not self.offload_opt else []
        return list(self.resident.values()) + masters

    def host_state_bytes(self) -> int:
        """Bytes of offloaded state in host memory at the step's peak: the host masters, their gradients
        (accumulated there during backward, in the masters' dtype) and AdamW's moments; 0 without offload."""
        if not self.offload_opt:
            return 0
        masters = sum(p.numel() * p.element_size() for p in self.opt_params.values())
        states = self.updater.states() if self.updater is not None else self.adamw.state.values()
        moments = sum(t.numel() * t.element_size() for st in states for t in st.values()
                      if torch.is_tensor(t) and t.dim() > 0)
        return 2 * masters + moments

    def device_state_bytes(self) -> int:
        """Bytes of parameters and optimizer state that stay on the device. Gradients, activations
        and prefetched weights are created during the step; the meter tracks them as they live."""
        params = sum(p.numel() * p.element_size() for p in self.resident.values())
        if self.offload_opt:
            return params
        masters = sum(p.numel() * 4 for p in self.opt_params.values()) if self.mixed else params
        return params + 3 * masters if self.mixed else 3 * params  # (compute copies,) masters, AdamW's two moments

    def optimizer_states(self):
        """AdamW's per-parameter state dicts (host optimizer's under offload)."""
        return self.updater.states() if self.updater is not None else self.adamw.state.values()

    def optimizer_state(self, q: torch.Tensor) -> dict:
        return self.updater.state_of(q) if self.updater is not None else self.adamw.state.get(q, {})

    def set_optimizer_state(self, q: torch.Tensor, state: dict) -> None:
        if self.updater is not None:
            self.updater.set_state(q, state)
        else:
            self.adamw.state[q] = state
