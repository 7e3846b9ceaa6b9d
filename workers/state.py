"""Canonical, plan-independent state: a rank's shards by parameter name, and full tensors from shards.

A shard is {name: {"shape", "shard_dim", "slice", "param", "exp_avg", "exp_avg_sq",
"optimizer_steps"}}: the full shape, the slice this rank holds, and its tensors.
`assemble` and `full_state` rebuild full tensors from any covering set of shards;
`import_full` cuts each rank's own TP slice back out, so state saved under one
plan restores into any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.shards import KEYS, MOMENTS, answer, cut, region_nbytes, shard_nbytes  # noqa: F401 (re-exported)
from workers.transfer import NeedRow

if TYPE_CHECKING:
    from workers.engine import Engine


def export_shards(engine: Engine, copy: bool = True) -> dict[str, dict]:
    """This rank's shards by canonical name: full shape, the slice held, tensor and AdamW state.

    `copy=False` (an in-place survivor keeping its own committed step, workers/restore.py `Kept.keep`): the
    tensors are the engine's own where they live in host memory (nothing copied; the engine must not update
    them again) and a host copy only of those on a device."""
    engine.settle()
    host = (lambda t: t.detach().cpu()) if not copy else (lambda t: t.detach().cpu().clone())
    out = {}
    steps = {float(st["step"]) for st in engine.optimizer_states() if "step" in st}
    for name in engine.module.params:
        spec = engine.module.specs[name]
        sl = spec.local_slice(engine.info.tp_rank, engine.stage_spec.tp)
        st = engine.optimizer_state(engine.opt_params[name])
        out[name] = {
            "shape": spec.shape, "shard_dim": spec.shard_dim,
            "slice": [(s.start or 0, s.stop if s.stop is not None else spec.shape[d]) for d, s in enumerate(sl)],
            "param": host(engine.opt_params[name]),  # the master (fp32 under mixed precision)
            "exp_avg": host(st["exp_avg"]) if "exp_avg" in st else None,
            "exp_avg_sq": host(st["exp_avg_sq"]) if "exp_avg_sq" in st else None,
            "optimizer_steps": max(steps) if steps else 0.0,
        }
    return out


def import_full(engine: Engine, full: dict[str, dict[str, torch.Tensor]], optimizer_steps: float) -> None:
    """Load this rank's slices of full canonical tensors ({name: {"param", "exp_avg", "exp_avg_sq"}})."""
    engine.settle()
    for name in engine.module.params:
        sl = engine.module.specs[name].local_slice(engine.info.tp_rank, engine.stage_spec.tp)
        _set_local(engine, name, {k: v[sl] if v is not None else None for k, v in full[name].items()}, optimizer_steps)


def local_region(engine: Engine, name: str) -> tuple[tuple[int, int], ...]:
    """The region [start, stop) per dimension of the full tensor that this rank holds."""
    spec = engine.module.specs[name]
    sl = spec.local_slice(engine.info.tp_rank, engine.stage_spec.tp)
    return tuple((s.start or 0, s.stop if s.stop is not None else spec.shape[d]) for d, s in enumerate(sl))


def needs(engine: Engine) -> list[NeedRow]:
    """What this rank must be given to resume: per unit, its region and bytes (param and both AdamW moments)."""
    out = []
    for name in engine.module.params:
        region = local_region(engine, name)
        numel = 1
        for a, b in region:
            numel *= b - a
        out.append(NeedRow(name, region, 3 * numel * engine.opt_params[name].element_size()))
    return out


def to_numpy(shards: dict[str, dict]) -> dict[str, dict]:
    """Shards with numpy arrays instead of CPU tensors: Ray moves numpy arrays without pickling their data."""
    return {n: {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for n, s in shards.items()}


def import_pieces(engine: Engine, pieces: dict[str, list[tuple]], optimizer_steps: float) -> None:
    """Load this rank's state from pieces: {unit: [(region, {"param", "exp_avg", "exp_avg_sq"}), ...]}
    whose regions tile the rank's own region of each unit (the restore planner's transfers). Pieces without
    the moments load the weights only; `import_moments` brings those later."""
    engine.settle()
    for name in engine.module.params:
        _set_local(engine, name, _local(engine, name, pieces[name]), optimizer_steps)


def import_moments(engine: Engine, pieces: dict[str, list[tuple]], optimizer_steps: float) -> None:
    """The second half of an overlapped restore: AdamW's moments from pieces as `import_pieces` takes them
    ({"exp_avg", "exp_avg_sq"} only), for the units that have pieces. It runs beside a step's forward and
    backward, which read the weights only; the step waits for it before its update (Engine.await_restore)."""
    for name, got in pieces.items():
        _set_moments(engine, name, _local(engine, name, got), optimizer_steps)


def _local(engine: Engine, name: str, pieces: list[tuple]) -> dict:
    """One unit's tensors in this rank's region, from pieces that tile it."""
    mine = local_region(engine, name)
    if len(pieces) == 1 and tuple(map(tuple, pieces[0][0])) == tuple(mine):  # one piece: as it is
        return {k: _tensor(v) for k, v in pieces[0][1].items()}
    shape = [b - a for a, b in mine]
    local: dict[str, torch.Tensor | None] = {}
    for region, tensors in pieces:
        idx = tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(region, mine, strict=True))
        for k, t in tensors.items():
            t = _tensor(t)
            if t is None:
                local.setdefault(k, None)
                continue
            if local.get(k) is None:
                local[k] = torch.empty(shape, dtype=t.dtype)
            dest = local[k]
            assert dest is not None
            dest[idx] = t
    return local


def _tensor(v):
    """A torch view of a numpy array (read-only when Ray delivered it; `_set_local` copies it), else `v`."""
    if v is None or isinstance(v, torch.Tensor):
        return v
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read, then copied
        return torch.from_numpy(v)


def _set_local(engine: Engine, name: str, src: dict, optimizer_steps: float) -> None:
    """Set one parameter (and its AdamW state, where `src` has it) from tensors already cut to this rank's region."""
    with torch.no_grad():
        p = engine.module.params[name]
        p.copy_(src["param"])
        q = engine.opt_params[name]
        if q is not p:  # the master (host under offload, fp32 under mixed precision)
            q.copy_(src["param"])
    _set_moments(engine, name, src, optimizer_steps)


def _set_moments(engine: Engine, name: str, src: dict, optimizer_steps: float) -> None:
    if src.get("exp_avg") is not None and optimizer_steps > 0:
        q = engine.opt_params[name]
        engine.set_optimizer_state(q, {
            "step": torch.tensor(optimizer_steps, dtype=torch.float32, device=q.device),  # fused AdamW: with its params
            "exp_avg": src["exp_avg"].to(q.device, q.dtype).clone(),
            "exp_avg_sq": src["exp_avg_sq"].to(q.device, q.dtype).clone(),
        })


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


def full_state(shards: list[dict[str, dict]]) -> tuple[dict[str, dict[str, torch.Tensor | None]], float]:
    """{name: {"param", "exp_avg", "exp_avg_sq"}} of full tensors, and the optimizer step count."""
    parts = {k: assemble(shards, k) for k in KEYS}
    steps = max((s["optimizer_steps"] for shard in shards for s in shard.values()), default=0.0)
    return {n: {k: parts[k].get(n) for k in parts} for n in parts["param"]}, steps
