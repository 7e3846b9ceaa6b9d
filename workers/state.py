"""Canonical, plan-independent state: assemble full tensors from shards by name."""

from __future__ import annotations

import torch


def assemble(shards: list[dict[str, dict]], key: str = "param") -> dict[str, torch.Tensor]:
    """Full tensors from any set of shards covering them (replicas may overlap; they agree)."""
    full: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, s in shard.items():
            if s.get(key) is None:
                continue
            t = full.setdefault(name, torch.empty(s["shape"], dtype=s[key].dtype))
            t[tuple(slice(a, b) for a, b in s["slice"])] = s[key]
    return full


def full_state(shards: list[dict[str, dict]]) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """{name: {"param", "exp_avg", "exp_avg_sq"}} of full tensors, and the optimizer step count."""
    parts = {k: assemble(shards, k) for k in ("param", "exp_avg", "exp_avg_sq")}
    steps = max((s["optimizer_steps"] for shard in shards for s in shard.values()), default=0.0)
    return {n: {k: parts[k].get(n) for k in parts} for n in parts["param"]}, steps
