"""Gradient sync and clipping of one rank's Engine (workers/engine.py), apart from its step loop, as torchtitan
keeps them: per (segment, TP rank) group one all-reduce bucket per layer (AutoHet's layer-wise sync across
asymmetric replicas), launched as the last backward finishes each layer; fp16 loss-scale unscaling; the
global-norm clip that counts every element once. A mixin of `Engine`: it reads the engine's module, groups,
device and train settings.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from planner.layout import extended_layer
from workers.engine_parts import EngineParts, grad


class GradSync(EngineParts):
    def _plan_sync(self) -> None:
        """Buckets: per (segment, TP rank) group (AutoHet §4, layer-wise sync across asymmetric replicas),
        one flat all-reduce per extended layer, last layer first, the order backward finishes them.

        Every rank of a group holds the same layers, so every rank issues the same all-reduces in
        the same order, whether it overlaps them with backward or not. With device gradients
        (no optimizer offload) and `overlap_sync`, a layer's bucket is launched asynchronously as
        soon as the last micro-batch's backward has accumulated its last gradient, so the
        all-reduce of layer k runs while layer k-1 is back-propagated (the cost model's
        assumption: the sync overlaps the last micro-batch's backward); `_sync_grads` waits
        for them before clipping. An offloaded stage's gradients stream to the host instead
        (workers/offload.py GradStream), each layer all-reduced on the device in the last
        micro-batch's backward, in the same order, in the group `layer_groups` names."""
        n_layers = self.model.num_layers
        self.buckets: list[tuple[int, object, list[str]]] = []  # (extended layer, group, parameter names)
        for gg, group in self.grad_groups:
            by_layer: dict[int, list[str]] = {}
            for name in self.grad_params:
                layer = extended_layer(self.module.specs[name].layer, n_layers)
                if gg.start <= layer < gg.end:
                    by_layer.setdefault(layer, []).append(name)
            self.buckets += [(layer, group, by_layer[layer]) for layer in sorted(by_layer, reverse=True)]
        self.layer_groups = {layer: group for layer, group, _ in self.buckets}  # an offloaded stage syncs by layer
        self._final_bwd = False  # counting gradients of the last micro-batch's backward
        self._inflight: list = []
        self.sync_trace: list[tuple[str, int, float]] = []  # ("ready" | "launch", layer, time) of the last step
        self._left: dict[int, int] = {}  # gradients per layer, counted down in the last backward
        self._sync_hooks: list = []  # removed with the groups their buckets name (Engine.drop_groups)
        if self.offload_opt:
            return
        by_name = {name: b for b in self.buckets for name in b[2]}
        for name, p in self.module.params.items():
            layer = extended_layer(self.module.specs[name].layer, n_layers)
            self._left[layer] = self._left.get(layer, 0) + 1
            self._sync_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad(layer, by_name.get(name))))

    def _on_grad(self, layer: int, bucket):
        def hook(_p: torch.Tensor) -> None:
            if not self._final_bwd:
                return
            self._count[layer] -= 1
            if self._count[layer] == 0:
                self.sync_trace.append(("ready", layer, time.perf_counter()))
                if bucket is not None and self.overlap_sync:
                    self._launch(bucket, async_op=True)

        return hook

    def _launch(self, bucket, async_op: bool) -> None:
        layer, group, names = bucket
        params = [self.grad_params[n] for n in names]
        flat = torch.cat([grad(p).reshape(-1) for p in params]).to(self.device)  # host grads: via the device
        self.sync_trace.append(("launch", layer, time.perf_counter()))
        work = dist.all_reduce(flat, group=group, async_op=async_op)
        self._inflight.append((id(bucket), work, flat, params))

    def _sync_grads(self) -> None:
        """Every bucket reduced: those launched during backward are waited for, the others run now. (An
        offloaded stage's are reduced by its gradient stream, workers/offload.py.)"""
        launched = {b for b, _, _, _ in self._inflight}
        for bucket in self.buckets:
            if id(bucket) not in launched:
                self._launch(bucket, async_op=False)
        for _, work, flat, params in self._inflight:
            if work is not None:
                work.wait()
            at = 0
            for p in params:
                p.grad.copy_(flat[at:at + p.numel()].view_as(p.grad))
                at += p.numel()
        self._inflight = []

    def _counted(self, name: str) -> bool:
        """Whether this rank's copy of `name` counts in the global norm: each element once, so replica 0 only,
        and TP-replicated parameters on TP rank 0 only."""
        return self.info.pipeline == 0 and (self.module.specs[name].shard_dim is not None or self.info.tp_rank == 0)

    def _norm_sq(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The sum of squares of `grads` on the device, in float64: torch's foreach norm per tensor (no copy of
        a gradient, where squaring each in float64 made one of each), summed over the tensors."""
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).double().square().to(self.device)

    def _scales(self, local_sq: torch.Tensor) -> None:
        """The global norm (every rank's sum of squares all-reduced) and what the update divides gradients by,
        as device tensors: no value is read on the host here (the step reads its summary once, at its end).

        `_grad_scale` = loss scale / clip coefficient, which the fused AdamW applies inside its kernel (unscaling
        and clipping without a pass of their own); `_found_inf` (fp16) is 1 when any gradient anywhere is not
        finite, which makes the kernel skip the update on every rank alike (torch.amp.GradScaler's rule; the
        scale is then halved on the host once the step's summary is read)."""
        fp16 = self.dtype == torch.float16
        self._norm_sq_all: torch.Tensor | None = None
        if not self.needs_norm:
            self._grad_scale = self._found_inf = None
            return
        dist.all_reduce(local_sq)
        self._norm_sq_all = local_sq
        norm = local_sq.sqrt() / self.loss_scale
        scale = torch.full((), self.loss_scale, dtype=torch.float64, device=self.device)
        if self.train.grad_clip is not None:
            scale = scale / (self.train.grad_clip / (norm + 1e-6)).clamp(max=1.0)
        self._grad_scale = scale.float()
        self._found_inf = (~torch.isfinite(norm)).float() if fp16 else None

    def _after_read(self, norm_sq: float) -> None:
        """The host's half, from the step's one read: whether fp16 overflowed (skip the update, halve the
        scale; 2000 good steps in a row double it) and, for a host optimizer, the scale as a host value."""
        self._host_scale = self._host_inf = None
        if self.needs_norm:  # the device's `_grad_scale` and `_found_inf` again, in the same float64 arithmetic
            norm = math.sqrt(norm_sq) / self.loss_scale
            clip = 1.0 if self.train.grad_clip is None else min(1.0, self.train.grad_clip / (norm + 1e-6))
            self._host_scale = torch.tensor(self.loss_scale / clip if clip else math.inf, dtype=torch.float32)
            if self.dtype == torch.float16:
                self._host_inf = torch.tensor(float(not math.isfinite(norm)))
        if self.dtype != torch.float16:
            self._skip = False
            return
        self._skip = not math.isfinite(norm_sq)
        self._good_steps = 0 if self._skip else self._good_steps + 1
        if self._skip:
            self.loss_scale /= 2
        elif self._good_steps % 2000 == 0:
            self.loss_scale *= 2

    @property
    def needs_norm(self) -> bool:
        """Whether the step computes the global gradient norm: to clip, or to find an fp16 overflow."""
        return self.train.grad_clip is not None or self.dtype == torch.float16
