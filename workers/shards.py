"""Shards as plain arrays, torch's or numpy's, without importing torch: cutting a region out of a shard, its bytes,
and the one shard server (`serve`).

A node's keeper (orchestrator/state/keeper.py) holds only numpy arrays, and serves them through these functions.
It never imports torch, which made each keeper start 2.5x slower and hold 240 MiB more of the host memory it
keeps state in (bench/keeper_start.py). A kept worker process serves its torch tensors through the same functions
(workers/restore.py). workers/state.py re-exports them beside the torch-side functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from workers.transfer import Piece, Region, Tier

MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's: needed only at a step's update, so a restore may bring them later
KEYS = ("param", *MOMENTS)


def cut(shard: dict, region, keys: tuple[str, ...] = KEYS) -> dict:
    """The arrays `keys` of `shard` (an export_shards entry, torch or numpy) inside `region`, a sub-region of its
    slice."""
    idx = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(region, shard["slice"], strict=True))
    whole = all(tuple(r) == tuple(s) for r, s in zip(region, shard["slice"], strict=True))
    out = {}
    for k in keys:
        t = shard.get(k)
        if t is None or whole:  # all of it: no copy here (Ray copies it once; a loader copies it in)
            out[k] = t
        else:  # a torch tensor's view is cloned, a numpy array's made contiguous: either way a copy of the region
            out[k] = t[idx].clone() if hasattr(t, "clone") else np.ascontiguousarray(t[idx])
    return out


def shard_nbytes(shard: dict, keys: tuple[str, ...] = KEYS) -> int:
    return sum(shard[k].nbytes for k in keys if shard.get(k) is not None)


def region_nbytes(shard: dict, region, keys: tuple[str, ...]) -> int:
    """The bytes `cut(shard, region, keys)` would give, without cutting."""
    numel = 1
    for a, b in region:
        numel *= b - a
    return sum(numel * shard[k].itemsize for k in keys if shard.get(k) is not None)


def answer(shard: dict, region: Region, keys: tuple[str, ...], tier: Tier) -> Piece:
    """A holder's answer for one region of a shard (a keeper's, or a kept worker process's): the tensors `keys`
    cut to it, their bytes, and the bytes of the keys left out (an overlapped restore asks for them later)."""
    tensors = cut(shard, region, keys)
    return Piece(Tier(tier), tensors, shard_nbytes(tensors),
                 region_nbytes(shard, region, tuple(k for k in KEYS if k not in keys)))


def serve(requests: list, keys: tuple[str, ...] | None, shard_of: Callable[[Any], dict],
          tier_of: Callable[[Any], Tier]) -> list[Piece]:
    """Each request's region cut from the shard `shard_of` finds for it: only the tensors `keys` (None: all), and
    the bytes of the others (an overlapped restore asks for AdamW's moments later)."""
    keys = KEYS if keys is None else tuple(keys)
    return [answer(shard_of(r), r.region, keys, tier_of(r)) for r in requests]
