"""Offload, as AutoHete runs it (§3-4): state in host memory, layer by layer, copies on lanes of their own.

Where the state lives (`HostLayers`): with the optimizer offloaded, each layer's fp32 master weights and fp32
gradients are one flat host buffer each (pinned on CUDA, preallocated once); the optimizer's parameters and
their `.grad` are views of them. So every copy moves a layer, never a parameter, and no copy stages through
pageable memory.

Gradients (`GradStream`): backward hands each gradient to the stream (a resident parameter's accumulate hook, a
fetched one's `_Fetch` backward); once a layer's are all in, they are packed and cast to fp32 on the device into
one of two preallocated buffers (the ring: double buffering, so the device holds at most two layers' fp32
gradients) and copied to the host on the d2h lane. Micro-batches after the first land in a pinned staging buffer
and are added on the cpu lane; the last micro-batch first brings that sum back and adds on the device. In the
last micro-batch a layer shared with other replicas is all-reduced there (AutoHet's layer-wise sync), and its
share of the global norm's square is summed on the lane, so nothing is read on the host inside the step.

The update (`LayerwiseUpdate`): after the step, torch's fused AdamW per layer on the cpu lane, first layers first,
with the step's loss scale and clip coefficient folded into the kernel (workers/adamw.py); a resident layer's new
weights go back on the h2d lane (one fp32 copy, cast on the device), and the next step's forward waits per layer,
so it starts while later layers are still updating (AutoHete's cross-iteration overlap).

Parameters (`ParamStore`): a block layer's weights visit the device only while it computes; its fp32 masters come
over on the h2d lane in one copy, are cast there, and are handed out `prefetch_depth` layers ahead; a
`saved_tensors_hooks` pair swaps autograd's saved weight copies for handles, which backward fetches again.

Accounting (`DeviceMeter`) works on CPU too: it counts the bytes a GPU would hold, namely resident parameters,
gradients and optimizer state (static), plus every tensor that forward and backward create on the device, and
what the lanes allocate there, while it lives (deduplicated by storage). Its peak is what the planner's
`cost.stage_memory` predicts; on CUDA `torch.cuda.max_memory_allocated` is reported beside it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.cost import OFFLOAD_CHUNK
from workers.copy_lane import DONE, Lane, Lanes, Ticket


class _TrackOutputs(TorchDispatchMode):
    """Every tensor an op creates on the device is counted while it lives, as an allocator would."""

    def __init__(self, meter: DeviceMeter, device: torch.device):
        super().__init__()
        self.meter, self.device = meter, device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.meter.paused_depth:
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                if t.untyped_storage().data_ptr() not in self.meter.static_ptrs:  # views of weights
                    self.meter.track(t)
        return out


class DeviceMeter:
    """Live and peak bytes resident on the device side: static state plus tracked tensors.

    With `enabled`, `tracking()` counts every tensor created on the device while
    it lives (a TorchDispatchMode: the CPU stand-in for CUDA's allocator
    statistics), including the transients of forward, backward and recompute.
    Host-side work runs outside it, or inside `paused()`.
    """

    def __init__(self, budget_bytes: float | None = None, enabled: bool = False, device: torch.device | None = None):
        self.enabled = enabled
        self.device = device or torch.device("cpu")
        self.static = 0
        self.static_ptrs: set[int] = set()
        self.paused_depth = 0
        self.live = 0
        self.peak = 0
        self.budget = budget_bytes
        self._storages: dict[int, list] = {}  # storage ptr -> [refs, bytes]
        self._lock = threading.Lock()

    def set_static(self, tensors: Sequence[torch.Tensor]) -> None:
        """The state that stays on the device all step (counted once, views of it never again)."""
        self.static_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        self.static = sum(t.untyped_storage().nbytes() for t in tensors)
        self._bump()

    def tracking(self):
        return _TrackOutputs(self, self.device) if self.enabled else contextlib.nullcontext()

    @contextlib.contextmanager
    def paused(self):
        """Host-side work inside a tracked region (a gradient copied to the host)."""
        self.paused_depth += 1
        try:
            yield
        finally:
            self.paused_depth -= 1

    def track(self, t: torch.Tensor) -> None:
        """Count `t`'s storage until the tensor object dies (several views count once)."""
        if not self.enabled:
            return
        st = t.untyped_storage()
        key, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0:
            return
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [1, nbytes]
                self.live += nbytes
            else:
                entry[0] += 1
        weakref.finalize(t, self._release, key)
        self._bump()

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self._storages[key]

    def _bump(self) -> None:
        now = self.static + self.live
        if now > self.peak:
            self.peak = now

    def reset_peak(self) -> None:
        self.peak = self.static + self.live


class HostLayers:
    """An offloaded optimizer's host state: per extended layer one flat fp32 buffer of master weights and one of
    gradients (pinned on CUDA), whose views are the optimizer's parameters (`params`) and their `.grad`."""

    def __init__(self, by_layer: dict[int, list[tuple[str, torch.Tensor]]], pin: bool):
        self.masters: dict[int, torch.Tensor] = {}
        self.grads: dict[int, torch.Tensor] = {}
        self.spans: dict[int, list[tuple[str, int, int, torch.Size]]] = {}  # layer -> (name, offset, numel, shape)
        self.params: dict[str, torch.nn.Parameter] = {}
        for layer, named in sorted(by_layer.items()):
            total = sum(t.numel() for _, t in named)
            dtype = named[0][1].dtype
            master = torch.empty(total, dtype=dtype, pin_memory=pin)
            grads = torch.zeros(total, dtype=dtype, pin_memory=pin)
            at, spans = 0, []
            for name, t in named:
                view = master[at:at + t.numel()].view(t.shape)
                view.copy_(t.detach())
                q = self.params[name] = torch.nn.Parameter(view)
                q.grad = grads[at:at + t.numel()].view(t.shape)
                spans.append((name, at, t.numel(), t.shape))
                at += t.numel()
            self.masters[layer], self.grads[layer], self.spans[layer] = master, grads, spans

    def size(self, layer: int) -> int:
        return self.masters[layer].numel()


class GradStream:
    """An offloaded optimizer's gradients, to host memory as backward produces them, a layer at a time.

    `begin(k, m)` before the k-th of m backwards of a step; `deliver(name, grad)` from the hooks; `finish()` after
    the last one: this rank's share of the global norm's square, on the device. `ready(layer)` is the ticket of a
    layer's final gradient on the host (the update waits on it)."""

    RING = 2  # device buffers of a layer's fp32 gradients: one packed while the other is copied out

    def __init__(self, host: HostLayers, lanes: Lanes, device: torch.device, meter: DeviceMeter,
                 counted: set[str], groups: dict[int, object], pin: bool):
        self.host, self.lanes, self.device, self.meter = host, lanes, device, meter
        self.groups, self.pin = groups, pin  # layer -> the process group its gradient is all-reduced in
        self.expect = {layer: {n for n, *_ in spans} for layer, spans in host.spans.items()}
        self.layer = {n: layer for layer, spans in host.spans.items() for n, *_ in spans}
        self.dtype = next(iter(host.masters.values())).dtype
        self.counted = {layer: [(a, k) for n, a, k, _ in spans if n in counted] for layer, spans in host.spans.items()}
        self.biggest = max(host.size(layer) for layer in host.spans)
        self.ring: list[torch.Tensor] = []
        self.free: list[Ticket] = [DONE] * self.RING  # when each ring buffer may be written again
        self.turn = 0
        self.staging: queue.Queue = queue.Queue()  # pinned buffers for micro-batches after the first
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.landed: dict[int, Ticket] = {}  # layer -> its gradient (sum so far) in host memory
        self.k, self.m = 0, 1
        self.sq: torch.Tensor | None = None

    def begin(self, k: int, m: int) -> None:
        self.k, self.m = k, m
        if k == 0:
            self.sq = torch.zeros((), dtype=torch.float64, device=self.device)
            self.landed = {}

    def deliver(self, name: str, grad: torch.Tensor) -> None:
        layer = self.layer[name]
        got = self.pending.setdefault(layer, {})
        got[name] = grad
        if len(got) == len(self.expect[layer]):
            self._flush(layer, self.pending.pop(layer))

    def _buffer(self) -> tuple[int, torch.Tensor, Ticket]:
        """The next ring buffer, once the copy out of its last chunk is done (the compute stream waits on the
        device; the host only until the lane has issued that copy)."""
        i, self.turn = self.turn, (self.turn + 1) % self.RING
        if len(self.ring) <= i:
            self.ring.append(torch.empty(min(self.biggest, OFFLOAD_CHUNK), dtype=self.dtype, device=self.device))
            self.meter.track(self.ring[i])
        self.free[i].device_wait()
        return i, self.ring[i], self.free[i]

    def _flush(self, layer: int, grads: dict[str, torch.Tensor]) -> None:
        """A layer's gradients, complete: packed and cast into ring buffers a chunk of at most `OFFLOAD_CHUNK`
        elements at a time (a block is usually one), each chunk copied out on the d2h lane."""
        spans, size = self.host.spans[layer], self.host.size(layer)
        final, d2h = self.k == self.m - 1, self.lanes.d2h
        flat_grads = {n: grads[n].reshape(-1) for n, *_ in spans}
        del grads
        for lo in range(0, size, OFFLOAD_CHUNK):
            hi = min(lo + OFFLOAD_CHUNK, size)
            slot, ring, free = self._buffer()
            flat = ring[:hi - lo]
            parts = [(max(a, lo), min(a + k, hi), n, a) for n, a, k, _ in spans if a < hi and a + k > lo]
            views = [flat[x - lo:y - lo] for x, y, _, _ in parts]
            src = [flat_grads[n][x - a:y - a] for x, y, n, a in parts]
            dest = self.host.grads[layer][lo:hi]
            with torch.no_grad():
                if final and self.k > 0:  # the earlier micro-batches' sum comes back, this one is added on the device
                    back = self.lanes.h2d.submit(partial(self._to_device, flat, dest), after=[self.landed[layer], free])
                    back.device_wait()
                    torch._foreach_add_(views, src)
                else:
                    torch._foreach_copy_(views, src)  # packed and cast to the masters' dtype on the device
            del views, src
            work = None
            if final and layer in self.groups:  # layer-wise sync across replicas (AutoHet), overlapping backward
                work = dist.all_reduce(flat, group=self.groups[layer], async_op=True)
            counted = [(max(a, lo) - lo, min(a + k, hi) - lo) for a, k in self.counted[layer] if a < hi and a + k > lo]
            after = [self.lanes.mark()]
            if final or self.k == 0:
                t = d2h.submit(partial(self._out, flat, dest, work, counted if final else []), after, keep=[flat])
                done = t
            else:
                buf = self._staging(hi - lo)
                t = d2h.submit(partial(self._out, flat, buf, None, []), after, keep=[flat])
                done = self.lanes.cpu.submit(partial(self._add, dest, buf), after=[t])
            self.free[slot] = t
        self.landed[layer] = done  # the lanes run in order: the last chunk's ticket covers the layer

    def _to_device(self, flat: torch.Tensor, src: torch.Tensor) -> None:
        flat.copy_(src, non_blocking=True)
        self.lanes.h2d.count(flat.numel() * flat.element_size())

    def _out(self, flat: torch.Tensor, dest: torch.Tensor, work, counted: list[tuple[int, int]]) -> None:
        """On the d2h lane: (after the chunk's all-reduce) its share of the norm, then one copy to the host."""
        if work is not None:
            work.wait()  # on CUDA: the lane's stream waits for the all-reduce, not the host
        if counted:
            assert self.sq is not None  # (begun)
            norm = torch.nn.utils.get_total_norm([flat[a:b] for a, b in counted], 2.0, foreach=True)
            self.sq += norm.double().square()
        dest.copy_(flat, non_blocking=True)
        self.lanes.d2h.count(flat.numel() * flat.element_size())

    def _staging(self, size: int) -> torch.Tensor:
        try:
            buf = self.staging.get_nowait()
        except queue.Empty:
            buf = torch.empty(min(self.biggest, OFFLOAD_CHUNK), dtype=self.dtype, pin_memory=self.pin)
        return buf[:size]

    def _add(self, dest: torch.Tensor, buf: torch.Tensor) -> None:
        dest.add_(buf)
        self.staging.put(buf._base if buf._base is not None else buf)

    def ready(self, layer: int) -> Ticket:
        return self.landed.get(layer, DONE)

    def finish(self) -> torch.Tensor:
        """After the last backward: every layer's gradient on its way out (the compute stream ordered after the
        lane's norms); this rank's share of the norm's square, on the device."""
        if self.pending:
            raise RuntimeError(f"gradients of layers {sorted(self.pending)} never completed in backward")
        for t in self.landed.values():
            t.device_wait()
        assert self.sq is not None  # (begun)
        return self.sq


class _Fetch(torch.autograd.Function):
    """A device copy of a host parameter; backward hands the gradient to the stream (GradStream.deliver).

    The graph edge is a shared 0-dim `anchor` leaf, not the host parameter, so autograd never holds a device
    copy after use nor accumulates on the host by itself.
    """

    @staticmethod
    def forward(ctx, anchor, device_copy, name, stream):
        ctx.name, ctx.stream = name, stream
        return device_copy

    @staticmethod
    def backward(ctx, grad):
        ctx.stream.deliver(ctx.name, grad)
        return None, None, None, None


class ParamStore:
    """Host-resident weights of some block layers, with prefetch `depth` layers ahead each way, fetched on the
    h2d lane: one fp32 copy of the layer's masters, cast on the device to the compute dtype."""

    def __init__(self, host: HostLayers, layers: list[int], device: torch.device, depth: int, meter: DeviceMeter,
                 lanes: Lanes, dtype: torch.dtype | None = None):
        self.host = host
        self.layers = sorted(layers)
        self.names = {layer: [n for n, *_ in host.spans[layer]] for layer in self.layers}
        self.device, self.depth, self.meter = device, max(0, depth), meter  # depth 0: serial, no prefetch
        self.lanes, self.lane, self.dtype = lanes, lanes.h2d, dtype  # dtype: the compute copies' (mixed precision)
        self.inflight: dict[tuple[str, int], Ticket] = {}  # (direction, layer) -> ticket
        self.by_ptr: dict[int, tuple[int, str]] = {}  # storage of a live forward weight copy -> (layer, name)
        self.phase = "fwd"  # the engine sets "bwd" around backward (recompute fetches then)
        self.bwd_cache: dict[int, dict[str, torch.Tensor]] = {}
        self.fetches = 0  # transfers issued: a test checks each layer is fetched once per use
        self.issued: list[tuple[str, int]] = []  # their order, against workers/offload_schedule.py
        self.anchor = torch.zeros((), requires_grad=True)
        self.updated: Callable[[int], Ticket] = lambda layer: DONE  # the layer's host update (LayerwiseUpdate)
        self.stream: GradStream | None = None  # where backward hands the weights' gradients

    # -- fetching ----------------------------------------------------------------
    def _request(self, direction: str, layer: int) -> None:
        """Issue a fetch of the layer. Its device buffer is allocated here, on the compute stream, where the
        copy is asked for (recorded on the lane that fills it): its bytes count from the moment the copy is
        issued, on the GPU's allocator and on the CPU's meter alike."""
        if (direction, layer) not in self.inflight and layer in self.names:
            self.fetches += 1
            self.issued.append((direction, layer))
            src = self.host.masters[layer]
            work = torch.empty(src.shape, dtype=self.dtype or src.dtype, device=self.device)
            self.meter.track(work)
            self.inflight[(direction, layer)] = self.lane.submit(partial(self._fetch, layer, work),
                                                                 after=[self.updated(layer)], keep=[work])

    def _fetch(self, layer: int, work: torch.Tensor) -> dict[str, torch.Tensor]:
        """On the h2d lane: the layer's masters in one copy, cast on the device (Lanes.upload)."""
        self.lanes.upload(self.host.masters[layer], [(0, work)])
        return {n: work[a:a + k].view(shape) for n, a, k, shape in self.host.spans[layer]}

    def _take(self, direction: str, layer: int) -> dict[str, torch.Tensor]:
        self._request(direction, layer)
        return self.inflight.pop((direction, layer)).take()

    def _ahead(self, direction: str, layer: int) -> list[int]:
        i = self.layers.index(layer)
        if direction == "fwd":
            return self.layers[i + 1:i + 1 + self.depth]
        nxt = self.layers[max(0, i - self.depth):i][::-1]
        return nxt

    def weights(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's device weights as autograd nodes whose gradients go to the gradient stream.

        In forward they come from the forward prefetch; during backward (a recomputed
        layer) from the backward cache the unpack hook also reads.
        """
        if self.phase == "bwd":
            got = self._backward_layer(layer)
        else:
            got = self._take("fwd", layer)
            for nxt in self._ahead("fwd", layer):
                self._request("fwd", nxt)
        out = {}
        for n, t in got.items():
            w = out[n] = _Fetch.apply(self.anchor, t, n, self.stream)
            if self.phase == "fwd":
                ptr = t.untyped_storage().data_ptr()
                self.by_ptr[ptr] = (layer, n)
                weakref.finalize(w, self.by_ptr.pop, ptr, None)
        return out

    def _backward_layer(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self.bwd_cache:
            for done in [k for k in self.bwd_cache if k > layer]:  # backward moved below them
                del self.bwd_cache[done]
            self.bwd_cache[layer] = self._take("bwd", layer)
            for nxt in self._ahead("bwd", layer):
                self._request("bwd", nxt)
        return self.bwd_cache[layer]

    def end_backward(self) -> None:
        """After one micro-batch's backward: drop its copies and any unused backward prefetch."""
        self.bwd_cache.clear()
        for key in [k for k in self.inflight if k[0] == "bwd"]:
            self.inflight.pop(key).device_wait()

    def drain(self) -> None:
        """Before the optimizer changes the host weights: no prefetched copy may outlive them."""
        for key in list(self.inflight):
            self.inflight.pop(key).device_wait()
        self.bwd_cache.clear()

    def close(self) -> None:
        self.drain()

    # -- saved tensors ------------------------------------------------------------
    def hooks(self):
        """saved_tensors_hooks: weight copies (and their views) become handles; the rest stays."""

        def pack(t: torch.Tensor):
            key = self.by_ptr.get(t.untyped_storage().data_ptr())
            if key is not None:
                return ("w", key[0], key[1], t.size(), t.stride(), t.storage_offset())
            return t

        def unpack(obj):
            if isinstance(obj, tuple) and obj and obj[0] == "w":
                _, layer, name, size, stride, offset = obj
                return self._backward_layer(layer)[name].as_strided(size, stride, offset)
            return obj

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class LayerwiseUpdate:
    """The offloaded optimizer: a fused AdamW per layer on the cpu lane, first layers first.

    AutoHete's cross-iteration overlap: `start()` returns at once; the lane updates layers in the order the next
    forward needs them (embedding, block 0, 1, ..., head), each once its gradient is on the host (`grads_ready`),
    and after each calls `after_layer`, which may return a ticket of further work the layer's next use waits for
    (a resident layer's new weights copied back to the device). The next iteration's forward waits per layer
    (`wait`), so it starts while the last layers are still updating. With `overlap=False` the update finishes
    before `start()` returns (the serial baseline). Per-layer fused AdamW computes the same values as one
    optimizer over all parameters.
    """

    def __init__(self, groups: list[tuple[int, list[torch.nn.Parameter]]], make_optimizer,
                 after_layer: Callable[[int], Ticket | None], overlap: bool = True, lane: Lane | None = None,
                 grads_ready: Callable[[int], Ticket] = lambda layer: DONE):
        self.order = [layer for layer, _ in sorted(groups, key=lambda g: g[0])]
        self.opts = {layer: make_optimizer(params) for layer, params in groups}
        self.owner = {id(p): self.opts[layer] for layer, params in groups for p in params}
        self.after_layer, self.overlap, self.grads_ready = after_layer, overlap, grads_ready
        self.own_lane = lane is None
        self.lane = lane if lane is not None else Lane("adamw")
        self.ready: dict[int, Ticket] = {}  # layer -> its update (result: the ticket of its copy back, or None)
        self.log: list[int] = []  # layers in the order they were updated (tests read it)
        self.scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def state_of(self, p: torch.Tensor) -> dict:
        return self.owner[id(p)].state.get(p, {})

    def set_state(self, p: torch.Tensor, state: dict) -> None:
        self.owner[id(p)].state[p] = state

    def states(self):
        for opt in self.opts.values():
            yield from opt.state.values()

    def start(self, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None) -> None:
        """Update every layer, on the lane: gradients divided by `grad_scale`, nothing changed where
        `found_inf` (host tensors: workers/adamw.py)."""
        self.join()
        self.scales = (grad_scale, found_inf)
        self.log = []
        for layer in self.order:
            self.ready[layer] = self.lane.submit(partial(self._update, layer), after=[self.grads_ready(layer)])
        if not self.overlap:
            self.join()

    def _update(self, layer: int) -> Ticket | None:
        self.opts[layer].step(*self.scales)
        self.log.append(layer)
        return self.after_layer(layer)

    def updated(self, layer: int) -> Ticket:
        """The ticket of the layer's host update (a fetch of its weights waits on it)."""
        return self.ready.get(layer, DONE)

    @staticmethod
    def _updated(t: Ticket) -> Ticket | None:
        """Wait for an update on the host; the ticket of its copy back (None: nothing copied back)."""
        try:
            return t.host_wait()
        except RuntimeError as e:
            raise RuntimeError(f"the host optimizer failed: {e.__cause__ or e}") from e

    def wait(self, layer: int) -> None:
        """Before the layer's next use: its update done, and the compute stream after its copy back."""
        t = self.ready.get(layer)
        back = self._updated(t) if t is not None else None
        if back is not None:
            back.device_wait()

    def join(self) -> None:
        """Every update and copy back done (before state is read or replaced)."""
        for t in list(self.ready.values()):
            back = self._updated(t)
            if back is not None:
                back.host_wait()

    def close(self) -> None:
        self.join()
        if self.own_lane:
            self.lane.close()
