"""What the parts of a rank's Engine (workers/engine.py) share: the attributes `Engine` sets that its mixins
(workers/grad_sync.py `GradSync`, workers/optim_state.py `OptimizerState`) read, declared once for the type
checker, and the few accessors they share (`grad`, `adamw`, `built`). torchtitan keeps such parts as components
of one trainer; this is their common view of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from planner.layout import RankInfo
    from planner.specs import ModelSpec, TrainSpec
    from workers.adamw import FusedAdamW
    from workers.copy_lane import Lanes
    from workers.model import Stage
    from workers.offload import DeviceMeter, GradStream, HostLayers, LayerwiseUpdate


def grad(p: torch.Tensor) -> torch.Tensor:
    """`p`'s gradient, which the step has produced by the time it is read (after backward)."""
    if p.grad is None:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient after backward")
    return p.grad


class EngineParts:
    # set in Engine.__init__
    model: ModelSpec
    train: TrainSpec
    info: RankInfo
    device: torch.device
    dtype: torch.dtype  # the stage's compute dtype
    mixed: bool  # mixed precision: fp32 masters apart from the compute copies
    loss_scale: float  # fp16's dynamic loss scale (1.0 otherwise)
    overlap_sync: bool
    grad_groups: list[tuple[Any, Any]]  # (planner.layout.GradGroup, its process group) this rank is in
    _good_steps: int
    _skip: bool  # fp16 overflow: this step's update is skipped
    # set when the stage is built (Engine.connect -> _build)
    module: Stage
    opt_params: dict[str, torch.nn.Parameter]  # the optimizer's parameters (masters where they are apart)
    offload_opt: bool
    separate: bool
    meter: DeviceMeter
    resident: dict[str, torch.nn.Parameter]
    resident_by_layer: dict[int, list[str]]
    updater: LayerwiseUpdate | None
    host: HostLayers | None  # an offloaded optimizer's host state, a flat buffer per layer
    lanes: Lanes | None  # its copy lanes
    grads: GradStream | None  # where its gradients go in backward
    layer_groups: dict[int, Any]  # extended layer -> the process group its gradient is all-reduced in
    optimizer: FusedAdamW | None
    _moments_counted: bool
    # set per step (Engine.step)
    _count: dict[int, int]
    host_reads: int  # device values read on the host, counted: one per step
    _grad_scale: torch.Tensor | None  # on the device: what the update divides gradients by (loss scale / clip)
    _found_inf: torch.Tensor | None  # on the device: 1 where an fp16 gradient overflowed
    _host_scale: torch.Tensor | None  # the same two on the host, from the step's one read (a host optimizer's)
    _host_inf: torch.Tensor | None
    _norm_sq_all: torch.Tensor | None  # the global gradient norm squared, on the device

    @property
    def grad_params(self) -> dict[str, torch.nn.Parameter]:  # OptimizerState's
        raise NotImplementedError

    @property
    def adamw(self) -> FusedAdamW:
        """The optimizer over every parameter (without optimizer offload; with it, the updater's per layer)."""
        if self.optimizer is None:
            raise RuntimeError("this stage's optimizer runs per layer on the host (optimizer offload)")
        return self.optimizer

    @property
    def built(self) -> bool:
        """Whether the stage is built (`module` and what goes with it exist: after Engine.connect)."""
        return "module" in vars(self)
