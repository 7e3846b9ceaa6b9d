"""The Plan: the contract between the planner and everything downstream.

A Plan lists data-parallel replicas (`pipelines`). Each replica owns a contiguous
range of every step's global samples, split into micro-batches, and a list of
stages. A stage is a contiguous layer range on a tensor-parallel group of GPUs of
one type on one node, with its offload policy. The orchestrator places actors
from it, workers build process groups from it, and recovery diffs two Plans.

Layer indexing: layer 0 is the first transformer block. The embedding belongs
to the first stage of each pipeline and the final norm and LM head to the last.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OffloadPolicy(_Model):
    """Per-stage memory policy (AutoHete §3: recompute, optimizer and parameter offload)."""

    recompute_layers: list[int] = Field(
        default_factory=list, description="global layer indices whose activations are recomputed"
    )
    offload_optimizer: bool = False
    offload_params: bool = False
    prefetch_depth: int = Field(default=1, ge=0, description="layers fetched ahead when params offloaded")
    reason: str = ""

    def describe(self) -> str:
        parts = []
        if self.recompute_layers:
            parts.append(f"recompute {len(self.recompute_layers)}")
        if self.offload_optimizer:
            parts.append("optimizer->host")
        if self.offload_params:
            parts.append(f"params->host (prefetch {self.prefetch_depth})")
        return ", ".join(parts) or "none"


class Stage(_Model):
    layer_start: int = Field(ge=0)
    layer_end: int = Field(description="exclusive")
    gpu_type: str
    node: str
    devices: list[str] = Field(min_length=1, description="TP group, in TP rank order")
    offload: OffloadPolicy = Field(default_factory=OffloadPolicy)

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @model_validator(mode="after")
    def _range(self) -> Stage:
        if self.layer_end < self.layer_start:
            raise ValueError(f"stage layer_end {self.layer_end} < layer_start {self.layer_start}")
        return self


class Pipeline(_Model):
    num_samples: int = Field(ge=1, description="samples of each global step this replica owns")
    micro_batch_size: int = Field(ge=1)
    num_micro_batches: int = Field(ge=1)
    schedule: str = Field(default="1f1b", pattern="^(1f1b|gpipe)$")
    stages: list[Stage] = Field(min_length=1)

    @model_validator(mode="after")
    def _micro_batches(self) -> Pipeline:
        m, b, n = self.num_micro_batches, self.micro_batch_size, self.num_samples
        if not (m - 1) * b < n <= m * b:
            raise ValueError(
                f"{m} micro-batches of {b} do not cover {n} samples; "
                f"need num_micro_batches = ceil(num_samples / micro_batch_size)"
            )
        return self

    def micro_batch_sizes(self) -> list[int]:
        b = self.micro_batch_size
        return [min(b, self.num_samples - i * b) for i in range(self.num_micro_batches)]


class UnusedDevice(_Model):
    device: str
    reason: str


class Estimate(_Model):
    step_time_s: float
    tokens_per_s: float
    mfu: float
    memory_gib: dict[str, float] = Field(description="predicted peak per device")
    bottleneck: str
    pipeline_time_s: list[float] = Field(default_factory=list, description="per replica, 1F1B")
    sync_time_s: float = 0.0
    cost_per_mtok: float | None = Field(default=None, description="$ per million tokens, if priced; with the "
                                       "expected preemption loss counted where nodes give preemptions_per_hour")
    host_gib: dict[str, float] = Field(default_factory=dict, description="offloaded state per node, GiB of host "
                                       "RAM (nodes without offload left out)")
    preemption_loss: float = Field(default=0.0, description="expected share of wall time lost to preemptions of the "
                                   "plan's nodes (their preemptions_per_hour x RECOVERY_S and half a step)")


class Plan(_Model):
    model_name: str
    num_layers: int
    global_batch: int
    pipelines: list[Pipeline] = Field(min_length=1)
    unused: list[UnusedDevice] = Field(default_factory=list)
    estimate: Estimate | None = None

    @property
    def estimated(self) -> Estimate:
        """`estimate`, which every plan the planner returns has (`evaluate` sets it); a plan built by hand and not
        evaluated yet raises."""
        if self.estimate is None:
            raise ValueError("the plan has no estimate yet: planner.evaluate(plan, cluster, model, train) sets it")
        return self.estimate

    def devices(self) -> list[str]:
        """All devices in rank order: pipeline, then stage, then TP rank."""
        return [d for p in self.pipelines for s in p.stages for d in s.devices]

    def nodes(self) -> list[str]:
        """The nodes the plan's stages run on, sorted."""
        return sorted({s.node for p in self.pipelines for s in p.stages})

    def sample_offsets(self) -> list[int]:
        """Start of each replica's contiguous range within a step's global batch."""
        offsets, acc = [], 0
        for p in self.pipelines:
            offsets.append(acc)
            acc += p.num_samples
        return offsets

    def check_structure(self) -> None:
        """Raise ValueError if the plan breaks a structural invariant of the contract."""
        total = sum(p.num_samples for p in self.pipelines)
        if total != self.global_batch:
            raise ValueError(f"pipelines' num_samples sum to {total}, not global_batch {self.global_batch}")
        seen: set[str] = set()
        tp_of_layer: dict[int, int] = {}
        for r, p in enumerate(self.pipelines):
            at = 0
            for s in p.stages:
                if s.layer_start != at:
                    raise ValueError(
                        f"pipeline {r}: stage starts at layer {s.layer_start}, expected {at}; "
                        "stages must cover layers contiguously"
                    )
                at = s.layer_end
                for d in s.devices:
                    if d in seen:
                        raise ValueError(f"device {d} appears twice in the plan")
                    seen.add(d)
                    if d.rsplit("/", 1)[0] != s.node:
                        raise ValueError(f"device {d} is not on stage node {s.node}; a TP group is one node")
                for layer in range(s.layer_start, s.layer_end):
                    if tp_of_layer.setdefault(layer, s.tp) != s.tp:
                        raise ValueError(
                            f"layer {layer} has TP degree {s.tp} in pipeline {r} but "
                            f"{tp_of_layer[layer]} elsewhere; a layer's TP degree must match in every replica"
                        )
            if at != self.num_layers:
                raise ValueError(f"pipeline {r} covers layers [0, {at}), model has {self.num_layers}")
