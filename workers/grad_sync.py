"""Gradient sync and clipping of one rank's Engine (workers/engine.py), apart from its step loop, as torchtitan
keeps them: per (segment, TP rank) group one all-reduce bucket per layer (AutoHet's layer-wise sync across
asymmetric replicas), launched as the last backward finishes each layer; fp16 loss-scale unscaling; the
global-norm clip that counts every element once. A mixin of `Engine`: it reads the engine's module, groups,
device and train settings.
"""

from __future__ import annotations

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
        for them before clipping. Offloaded gradients stream to the host instead, and their
        buckets are reduced after backward, in the same order."""
        n_layers = self.model.num_layers
        self.buckets: list[tuple[int, object, list[str]]] = []  # (extended layer, group, parameter names)
        for gg, group in self.grad_groups:
            by_layer: dict[int, list[str]] = {}
            for name in self.grad_params:
                layer = extended_layer(self.module.specs[name].layer, n_layers)
                if gg.start <= layer < gg.end:
                    by_layer.setdefault(layer, []).append(name)
            self.buckets += [(layer, group, by_layer[layer]) for layer in sorted(by_layer, reverse=True)]
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
        """Every bucket reduced: those launched during backward are waited for, the others run now."""
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

    def _unscale(self) -> None:
        """fp16: gradients back to their true scale; a non-finite one anywhere skips the update on every
        rank and halves the scale; 2000 good steps in a row double it (torch.amp.GradScaler's rule)."""
        bad = torch.zeros((), device=self.device)
        for p in self.grad_params.values():
            if p.grad is not None:
                p.grad.mul_(1.0 / self.loss_scale)
                bad = torch.maximum(bad, (~torch.isfinite(p.grad)).any().float().to(self.device))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self._skip = bool(bad.item())
        self._good_steps = 0 if self._skip else self._good_steps + 1
        if self._skip:
            self.loss_scale /= 2
        elif self._good_steps % 2000 == 0:
            self.loss_scale *= 2

    def _clip(self) -> None:
        """Global-norm clip; each element counted once: replica 0 only, TP-replicated params on TP rank 0."""
        if self.train.grad_clip is None:
            return
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.info.pipeline == 0:
            for name, p in self.grad_params.items():
                if self.module.specs[name].shard_dim is not None or self.info.tp_rank == 0:
                    sq += grad(p).double().pow(2).sum().to(self.device)
        dist.all_reduce(sq)
        coef = self.train.grad_clip / (float(sq.sqrt()) + 1e-6)
        if coef < 1.0:
            for p in self.grad_params.values():
                grad(p).mul_(coef)
