"""Copy lanes: where an offloaded stage's copies and host work run, beside the compute stream and never on it.

AutoHete (§4) schedules an offloaded stage on four lanes: compute, host-to-device copies, device-to-host copies
and the CPU optimizer (planner/offload_schedule.py costs that schedule). A `Lane` is one of the last three: an
ordered queue of jobs run by a thread of its own. On CUDA a device lane owns a stream; a job's copies and casts
are issued on it, ordered after the events of what it depends on, and its ticket carries an event recorded after
them, so the compute stream waits on a ticket (`device_wait`) without the host waiting, and the host waits
(`host_wait`) only where it consumes the bytes. On the CPU the same lane runs the job on its thread and the
ticket is done when the job has run: the engine's code is the same on both, and tests run it here.

Memory a job touches: device tensors made on the compute stream and read by a job are passed as `keep`
(`record_stream`, held by the job until it is issued, so the allocator cannot hand them out while the lane still
reads them); tensors a job makes and the compute stream reads are recorded on it by `Ticket.take`. Host buffers
are pinned and preallocated by their owners (workers/offload.py), so a copy never stages through pageable memory.

Every copy is counted by direction (`copies`, `bytes`): tests hold the engine to one copy per layer, not one per
parameter.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class Ticket:
    """A job's completion: `result` is what its function returned."""

    def __init__(self, event=None, done: bool = False):
        self.issued = threading.Event()  # the job ran (CPU, host lanes) or was issued on its stream (CUDA)
        self.event = event  # a CUDA event recorded after the job's device work, on a device lane
        self.result: Any = None
        self.error: BaseException | None = None
        if done:
            self.issued.set()

    def _ran(self) -> None:
        self.issued.wait()
        if self.error is not None:
            raise RuntimeError(f"a copy-lane job failed: {type(self.error).__name__}: {self.error}") from self.error

    def host_wait(self) -> Any:
        """Block this thread until the job's work is done, device work included; its result."""
        self._ran()
        if self.event is not None:
            self.event.synchronize()
        return self.result

    def device_wait(self) -> Any:
        """Order the current stream after the job (no host wait for the device work; on the CPU, the job has
        run); its result."""
        self._ran()
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return self.result

    def take(self) -> Any:
        """`device_wait`, and the result's device tensors recorded on the current stream, which reads them now."""
        out = self.device_wait()
        if self.event is not None:
            stream = torch.cuda.current_stream()
            for t in _tensors(out):
                if t.is_cuda:
                    t.record_stream(stream)
        return out


def mark(device: torch.device) -> Ticket:
    """A ticket for everything the current (compute) stream has been given so far: a job after it starts on
    the device only when that work is done. On the CPU the work is done already."""
    if device.type != "cuda":
        return Ticket(done=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return Ticket(ev, done=True)


DONE = Ticket(done=True)


class Lane:
    """An ordered queue of jobs on a thread of its own; with a CUDA `device`, issued on a stream of its own."""

    def __init__(self, name: str, device: torch.device | None = None):
        self.name = name
        self.stream = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.copies = 0  # copies this lane made (`count`), and their bytes
        self.bytes = 0
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"hetspot-{name}")
        self._thread.start()

    def submit(self, fn: Callable[[], Any], after: Sequence[Ticket] = (), keep: Sequence[torch.Tensor] = ()) -> Ticket:
        """Run `fn` on the lane once every ticket in `after` is done: on a CUDA lane its device work goes on the
        lane's stream, after theirs. `keep`: device tensors of another stream that `fn` reads."""
        ticket = Ticket()
        if self.stream is not None:
            for t in keep:
                if t.is_cuda:
                    t.record_stream(self.stream)
        self._jobs.put((fn, tuple(after), tuple(keep), ticket))
        return ticket

    def count(self, nbytes: int) -> None:
        """One copy of `nbytes` (jobs call it for each copy they make)."""
        self.copies += 1
        self.bytes += nbytes

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, after, keep, ticket = job
            del job
            try:
                self._after(after)
                with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
                    ticket.result = fn()
                    if self.stream is not None:
                        ticket.event = torch.cuda.Event()
                        ticket.event.record(self.stream)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the ticket, on its thread
                ticket.error = e
            # The job's tensors and its ticket (whose result the waiter takes) go before the waiter wakes: a lane
            # thread that the OS runs late must not hold a layer the compute side has finished with.
            issued = ticket.issued
            del fn, after, keep, ticket
            issued.set()

    def _after(self, after: tuple[Ticket, ...]) -> None:
        """Wait for the jobs this one follows: on the device where both have events, else on this thread. In a
        function of its own, so that no loop variable of the lane's loop keeps the last one's ticket (and the
        tensors of its result) alive while the thread waits for its next job."""
        for dep in after:
            if self.stream is not None and dep.event is not None:
                dep._ran()
                self.stream.wait_event(dep.event)
            else:
                dep.host_wait()


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class Lanes:
    """An offloaded stage's three lanes (AutoHete's h2d, d2h and cpu) for one device.

    `upload` (on the h2d lane) moves a flat host buffer to device tensors (several, or of another dtype) through
    one preallocated device buffer of `staging_numel` elements in the host's dtype: one copy, then the cast or
    the scatter into the tensors on the device, chunk by chunk (a layer no larger than the buffer is one copy).
    The buffer lives as long as the lanes, so its bytes are a constant of the stage (`cost.fetch_staging`)."""

    def __init__(self, device: torch.device, staging_numel: int = 0,
                 track: Callable[[torch.Tensor], None] = lambda t: None):
        self.device = device
        self.h2d = Lane("h2d", device)
        self.d2h = Lane("d2h", device)
        self.cpu = Lane("cpu")  # host work: adds of accumulated gradients, the host AdamW
        self.staging_numel, self._track = staging_numel, track
        self._staging: torch.Tensor | None = None

    def upload(self, src: torch.Tensor, pieces: Sequence[tuple[int, torch.Tensor]]) -> None:
        """On the h2d lane: `src` (flat, host) into `pieces`, each (offset into `src`, flat device tensor)."""
        if len(pieces) == 1 and pieces[0][1].dtype == src.dtype:  # one piece, no cast: straight into place
            at, t = pieces[0]
            t.copy_(src[at:at + t.numel()], non_blocking=True)
            self.h2d.count(t.numel() * t.element_size())
            return
        if self._staging is None or self._staging.dtype != src.dtype:
            self._staging = torch.empty(max(self.staging_numel, 1), dtype=src.dtype, device=self.device)
            self._track(self._staging)
        buf, step = self._staging, self._staging.numel()
        for lo in range(0, src.numel(), step):
            hi = min(lo + step, src.numel())
            buf[:hi - lo].copy_(src[lo:hi], non_blocking=True)
            self.h2d.count((hi - lo) * src.element_size())
            for at, t in pieces:  # the cast, into the parts of each piece inside [lo, hi)
                a, b = max(lo, at), min(hi, at + t.numel())
                if a < b:
                    t[a - at:b - at].copy_(buf[a - lo:b - lo])

    def mark(self) -> Ticket:
        return mark(self.device)

    def close(self) -> None:
        for lane in (self.h2d, self.d2h, self.cpu):
            lane.close()

    def copies(self) -> dict[str, int]:
        return {"h2d": self.h2d.copies, "d2h": self.d2h.copies}
