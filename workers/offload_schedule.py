"""Priority schedule of host<->device copies and CPU AdamW for one stage (AutoHete §4), as pure data.

The stage's compute lane runs forward over layers 0..L-1, then backward L-1..0,
for consecutive iterations. Three more lanes (host-to-device copies,
device-to-host copies, the CPU optimizer) each run one op at a time. An op
becomes ready when its producer ends; among ready ops a lane picks the one
whose consumer comes first (its `need` rank). So:
  - gradients stream device->host as backward produces them, layer by layer;
  - the CPU updates the first layers first, and next iteration's forward of
    layer l starts as soon as layer l is updated and back on the device, while
    the last layers are still updating: cross-iteration overlap;
  - with parameter offload, a layer's weights are prefetched `prefetch_depth`
    layers ahead of its forward and again of its backward.
`overlap=False` gives the serial baseline: copies and updates wait for the
iteration's compute, and the next iteration waits for all of them.
No torch here: the engine executes this order; tests check it without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    kind: str  # fwd | bwd | h2d_fwd | h2d_bwd | d2h_grad | adam | h2d_update
    layer: int
    iteration: int
    lane: str  # compute | h2d | d2h | cpu
    start_s: float
    end_s: float


@dataclass(frozen=True)
class StageTimes:
    fwd_s: float  # per layer
    bwd_s: float
    h2d_s: float  # one layer's weights host->device
    d2h_s: float  # one layer's gradients device->host
    adam_s: float  # one layer's CPU AdamW


def schedule(num_layers: int, t: StageTimes, offload_optimizer: bool, offload_params: bool,
             prefetch_depth: int = 1, iterations: int = 2, overlap: bool = True) -> list[Op]:
    """Event-driven list schedule of `iterations` training iterations of one stage."""
    L = num_layers
    compute = []
    for i in range(iterations):
        compute += [("fwd", layer, i) for layer in range(L)] + [("bwd", layer, i) for layer in reversed(range(L))]
    position = {key: n for n, key in enumerate(compute)}  # when each compute op needs its inputs
    done: dict[tuple[str, int, int], float] = {}
    lanes_free = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "cpu": 0.0}
    out: list[Op] = []
    pending = _transfers(L, iterations, offload_optimizer, offload_params)
    c = 0  # next compute op

    def deps(kind: str, layer: int, i: int) -> list[tuple[str, int, int]]:
        d = []
        if kind == "fwd":
            if offload_params:
                d.append(("h2d_fwd", layer, i))
            elif offload_optimizer and i > 0:
                d.append(("h2d_update", layer, i - 1))
            if not overlap and i > 0:
                d += [("adam", x, i - 1) for x in range(L)] + ([("h2d_update", x, i - 1) for x in range(L)]
                                                               if offload_optimizer and not offload_params else [])
        elif kind == "bwd" and offload_params:
            d.append(("h2d_bwd", layer, i))
        elif kind == "d2h_grad":
            d.append(("bwd", layer, i) if overlap else ("bwd", 0, i))
        elif kind == "adam":
            d.append(("d2h_grad", layer, i))
        elif kind == "h2d_update":
            d.append(("adam", layer, i))
        elif kind == "h2d_fwd":
            if i > 0:
                d.append(("adam", layer, i - 1))
            if layer - prefetch_depth - 1 >= 0:  # issue only inside the prefetch window
                d.append(("fwd", layer - prefetch_depth - 1, i))
        elif kind == "h2d_bwd":
            if layer + prefetch_depth + 1 < L:
                d.append(("bwd", layer + prefetch_depth + 1, i))
            else:
                d.append(("fwd", L - 1, i))
        return d

    def ready_at(key) -> float | None:
        ts = [done.get(k) for k in deps(*key)]
        return None if any(x is None for x in ts) else max((x for x in ts if x is not None), default=0.0)

    durations = {"fwd": t.fwd_s, "bwd": t.bwd_s, "h2d_fwd": t.h2d_s, "h2d_bwd": t.h2d_s,
                 "d2h_grad": t.d2h_s, "adam": t.adam_s, "h2d_update": t.h2d_s}
    lane_of = {"h2d_fwd": "h2d", "h2d_bwd": "h2d", "h2d_update": "h2d", "d2h_grad": "d2h", "adam": "cpu"}

    def need(key) -> int:
        kind, layer, i = key
        consumer = {"h2d_fwd": ("fwd", layer, i), "h2d_bwd": ("bwd", layer, i),
                    "h2d_update": ("fwd", layer, i + 1), "adam": ("fwd", layer, i + 1),
                    "d2h_grad": ("fwd", layer, i + 1)}[kind]
        return position.get(consumer, len(position))

    while c < len(compute) or pending:
        # Candidate next event on each lane; take the earliest start (ties: compute first, then lane order).
        best = None
        if c < len(compute):
            r = ready_at(compute[c])
            if r is not None:
                best = (max(r, lanes_free["compute"]), 0, "compute", compute[c])
        for lane_i, lane in enumerate(("h2d", "d2h", "cpu"), start=1):
            at = {k: ready_at(k) for k in pending if lane_of[k[0]] == lane}
            ready = [(k, r) for k, r in at.items() if r is not None]
            if not ready:
                continue
            start = max(min(r for _, r in ready), lanes_free[lane])
            # Among ops ready by the time the lane is free, the one needed soonest goes first.
            eligible = [k for k, r in ready if r <= start] or [min(ready, key=lambda kr: kr[1])[0]]
            key = min(eligible, key=lambda k: (need(k), k))
            cand = (max(dict(ready)[key], lanes_free[lane]), lane_i, lane, key)
            if best is None or cand[:2] < best[:2]:
                best = cand
        assert best is not None, "schedule deadlock"  # programmer invariant
        start, _, lane, key = best
        end = start + durations[key[0]]
        lanes_free[lane] = end
        done[key] = end
        out.append(Op(key[0], key[1], key[2], lane, start, end))
        if lane == "compute":
            c += 1
        else:
            pending.remove(key)
    return out


def _transfers(L: int, iterations: int, offload_optimizer: bool, offload_params: bool) -> list[tuple[str, int, int]]:
    ops = []
    for i in range(iterations):
        for layer in range(L):
            if offload_params:
                ops += [("h2d_fwd", layer, i), ("h2d_bwd", layer, i)]
            if offload_optimizer or offload_params:
                ops += [("d2h_grad", layer, i), ("adam", layer, i)]
                if not offload_params:
                    ops.append(("h2d_update", layer, i))
    return ops


def makespan(ops: list[Op], iteration: int) -> float:
    """End of the iteration's last compute op."""
    return max(o.end_s for o in ops if o.lane == "compute" and o.iteration == iteration)
