"""Parameter offload with prefetch, gradient streaming, and device-memory accounting (AutoHete §3-4).

Parameter offload: a block layer's weights live in host memory (the optimizer's
fp32 master copies, pinned on CUDA). They visit the device only while the layer
computes:
  - forward: `ParamStore.weights(layer)` hands out device copies, waiting for
    the prefetch issued `depth` layers earlier, and issues the next prefetches;
  - autograd would keep those copies alive until backward, so a
    `saved_tensors_hooks` pair swaps every saved weight copy (or a view of it,
    like linear's `W.t()`) for a small handle, and in backward the unpack hook
    fetches the layer again, prefetching `depth` layers ahead in reverse order;
  - `_Fetch` is the autograd edge between host and device: its backward copies
    the weight gradient device->host, where it accumulates into the host
    parameter's `.grad` (gradients stream to the host layer by layer).
Copies run on a side lane (a CUDA stream, or a thread on CPU) in the order the
consumer needs them, so they overlap compute: the execution of the
priority order in workers/offload_schedule.py.

Accounting (`DeviceMeter`) works on CPU too: it counts the bytes a GPU would
hold, namely resident parameters, gradients and optimizer state (static), plus
every tensor that forward and backward create on the device, prefetched weight
copies included, while it lives (deduplicated by storage). Its peak is what
the planner's `cost.stage_memory` predicts; on CUDA
`torch.cuda.max_memory_allocated` is reported beside it.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


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


class _Copier:
    """The host->device lane: copies run in the order they were requested, off the compute path."""

    def __init__(self, device: torch.device, meter: DeviceMeter, dtype: torch.dtype | None = None):
        self.device, self.meter, self.dtype = device, meter, dtype  # dtype: the compute copies' (mixed precision)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
        else:
            self.jobs: queue.Queue = queue.Queue()
            self.thread = threading.Thread(target=self._run, daemon=True, name="hetspot-h2d")
            self.thread.start()

    def submit(self, tensors: dict[str, torch.Tensor], before: Callable[[], None] = lambda: None):
        """Start copying once `before()` returns (the host copy is up to date); a ticket for `wait`."""
        if self.cuda:
            before()
            with torch.cuda.stream(self.stream):
                out = {n: t.to(self.device, self.dtype or t.dtype, non_blocking=True) for n, t in tensors.items()}
                for t in out.values():  # device memory from the moment the copy is issued
                    self.meter.track(t)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            return out, ev
        box: dict = {}
        done = threading.Event()
        self.jobs.put((tensors, box, done, before))
        return box, done

    def wait(self, ticket) -> dict[str, torch.Tensor]:
        out, ev = ticket
        if self.cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(ev)
            for t in out.values():
                t.record_stream(cur)
            return out
        ev.wait()
        if "error" in out:
            raise out["error"]
        return out["tensors"]

    def close(self) -> None:
        if not self.cuda:
            self.jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            tensors, box, done, before = job
            try:  # a separate buffer, as a GPU copy would be; the clone releases the GIL
                before()
                box["tensors"] = {n: t.detach().to(self.dtype or t.dtype, copy=True) for n, t in tensors.items()}
                for t in box["tensors"].values():  # device memory from the moment the copy is issued
                    self.meter.track(t)
            except Exception as e:  # handed to the consumer, which raises it on its thread
                box["error"] = e
            done.set()
            del job, tensors, box, done, before  # the consumer owns the copies now


class _Fetch(torch.autograd.Function):
    """A device copy of a host parameter; backward adds the gradient into the host `.grad`.

    The graph edge is a shared 0-dim `anchor` leaf, not the host parameter, so
    autograd never holds a device copy after use nor accumulates on the host by
    itself; the accumulation here is host work, outside the device meter.
    """

    @staticmethod
    def forward(ctx, anchor, device_copy, host_param, meter):
        ctx.host, ctx.meter = host_param, meter
        return device_copy

    @staticmethod
    def backward(ctx, grad):
        with ctx.meter.paused():
            g = grad.to("cpu", ctx.host.dtype, copy=True)  # the master's dtype (fp32 under mixed precision)
            if ctx.host.grad is None:
                ctx.host.grad = g
            else:
                ctx.host.grad.add_(g)
        return None, None, None, None


class ParamStore:
    """Host-resident weights of some block layers, with prefetch `depth` layers ahead each way."""

    def __init__(self, host_params: dict[str, torch.nn.Parameter], layer_of: Callable[[str], int],
                 layers: list[int], device: torch.device, depth: int, meter: DeviceMeter,
                 dtype: torch.dtype | None = None):
        self.host = host_params
        self.layers = sorted(layers)
        self.names = {layer: [n for n in host_params if layer_of(n) == layer] for layer in self.layers}
        self.device, self.depth, self.meter = device, max(0, depth), meter  # depth 0: serial, no prefetch
        self.copier = _Copier(device, meter, dtype)
        self.inflight: dict[tuple[str, int], object] = {}  # (direction, layer) -> ticket
        self.by_ptr: dict[int, tuple[int, str]] = {}  # storage of a live forward weight copy -> (layer, name)
        self.phase = "fwd"  # the engine sets "bwd" around backward (recompute fetches then)
        self.bwd_cache: dict[int, dict[str, torch.Tensor]] = {}
        self.fetches = 0  # transfers issued: a test checks each layer is fetched once per use
        self.issued: list[tuple[str, int]] = []  # their order, against workers/offload_schedule.py
        self.anchor = torch.zeros((), requires_grad=True)
        self.before_copy: Callable[[int], None] = lambda layer: None  # waits for the layer's update

    # -- fetching ----------------------------------------------------------------
    def _request(self, direction: str, layer: int) -> None:
        if (direction, layer) not in self.inflight and layer in self.names:
            self.fetches += 1
            self.issued.append((direction, layer))
            self.inflight[(direction, layer)] = self.copier.submit({n: self.host[n] for n in self.names[layer]},
                                                                   lambda: self.before_copy(layer))

    def _take(self, direction: str, layer: int) -> dict[str, torch.Tensor]:
        self._request(direction, layer)
        return self.copier.wait(self.inflight.pop((direction, layer)))

    def _ahead(self, direction: str, layer: int) -> list[int]:
        i = self.layers.index(layer)
        if direction == "fwd":
            return self.layers[i + 1:i + 1 + self.depth]
        nxt = self.layers[max(0, i - self.depth):i][::-1]
        return nxt

    def weights(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's device weights as autograd nodes whose gradients flow to the host.

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
            w = out[n] = _Fetch.apply(self.anchor, t, self.host[n], self.meter)
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
            self.copier.wait(self.inflight.pop(key))

    def drain(self) -> None:
        """Before the optimizer changes the host weights: no prefetched copy may outlive them."""
        for key in list(self.inflight):
            self.copier.wait(self.inflight.pop(key))
        self.bwd_cache.clear()

    def close(self) -> None:
        self.drain()
        self.copier.close()

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
    """The offloaded optimizer: a fused AdamW per layer on the host, run on a thread, first layers first.

    AutoHete's cross-iteration overlap: `start()` returns at once; the thread
    updates layers in the order the next forward needs them (embedding, block
    0, 1, ..., head), and after each layer calls `after_layer` (copy the new
    weights back to resident device copies) and marks it ready. The next
    iteration's forward waits per layer (`wait`), so it starts while the last
    layers are still updating. With `overlap=False` the update finishes before
    `start()` returns (the serial baseline). Per-layer fused AdamW computes the
    same values as one optimizer over all parameters.
    """

    def __init__(self, groups: list[tuple[int, list[torch.nn.Parameter]]], make_optimizer,
                 after_layer: Callable[[int], None], overlap: bool = True):
        self.order = [layer for layer, _ in sorted(groups, key=lambda g: g[0])]
        self.opts = {layer: make_optimizer(params) for layer, params in groups}
        self.owner = {id(p): self.opts[layer] for layer, params in groups for p in params}
        self.after_layer, self.overlap = after_layer, overlap
        self.ready = {layer: threading.Event() for layer in self.order}
        for ev in self.ready.values():
            ev.set()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.log: list[int] = []  # layers in the order they were updated (tests read it)

    def state_of(self, p: torch.Tensor) -> dict:
        return self.owner[id(p)].state.get(p, {})

    def set_state(self, p: torch.Tensor, state: dict) -> None:
        self.owner[id(p)].state[p] = state

    def states(self):
        for opt in self.opts.values():
            yield from opt.state.values()

    def start(self) -> None:
        self.join()
        for ev in self.ready.values():
            ev.clear()
        self.log = []
        self.thread = threading.Thread(target=self._run, daemon=True, name="hetspot-adamw")
        self.thread.start()
        if not self.overlap:
            self.join()

    def _run(self) -> None:
        try:
            for layer in self.order:
                opt = self.opts[layer]
                opt.step()
                opt.zero_grad(set_to_none=True)
                self.after_layer(layer)
                self.log.append(layer)
                self.ready[layer].set()
        except BaseException as e:  # re-raised on the training thread at its next wait
            self.error = e
            for ev in self.ready.values():
                ev.set()

    def wait(self, layer: int) -> None:
        ev = self.ready.get(layer)
        if ev is not None:
            ev.wait()
        if self.error is not None:
            raise RuntimeError(f"the host optimizer failed: {self.error}") from self.error

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            raise RuntimeError(f"the host optimizer failed: {self.error}") from self.error
