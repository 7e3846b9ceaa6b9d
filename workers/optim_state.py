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
from workers.engine_parts import EngineParts


class OptimizerState(EngineParts):
    def _adamw(self, params: list) -> FusedAdamW:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": self.train.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return FusedAdamW([g for g in groups if g["params"]], lr=self.train.lr, betas=self.train.betas,
                          eps=self.train.eps)

    def _copy_back(self, layer: int) -> None:
        """After a layer's host update: its resident device copies take the new weights."""
        with torch.no_grad():
            for n in self.resident_by_layer.get(layer, ()):
                self.resident[n].copy_(self.opt_params[n], non_blocking=True)

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
        if self.updater is not None and self._skip:  # fp16 overflow: no update this step
            for q in self.opt_params.values():
                q.grad = None
            return
        if self.updater is not None:  # host AdamW per layer on a thread; the next forward waits per layer
            self.updater.start()
            return
        if not self._skip:
            self.adamw.step()
        self.adamw.zero_grad(set_to_none=True)
        if self.mixed:  # the compute copies take the new master weights
            with torch.no_grad():
                for n, p in self.module.params.items():
                    p.copy_(self.opt_params[n])
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
