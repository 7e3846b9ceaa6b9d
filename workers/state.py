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
