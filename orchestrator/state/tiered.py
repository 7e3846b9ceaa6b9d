"""`TieredSnapshots`: the controller's CheckpointStore over two tiers, memory and S3.

Every snapshot goes to memory (the newest one, `MemorySnapshots`); every
`s3_every`-th goes to S3 as well, uploaded on a background thread so no
training step waits for it, then old steps are pruned to `keep`. `latest()`
answers from memory when it can and from the newest verified S3 step
otherwise (a resumed job, or a failure before the first snapshot), and records
which tier it read and how many bytes, for the recovery report.

What is not here yet (issue: Recovery, part 1): snapshots still pass through the
controller's process; peer keepers on other nodes and restoring from survivors'
live shards (orchestrator/state/restore_plan.py plans those) come next.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from orchestrator.state.snapshots import MemorySnapshots

log = logging.getLogger("hetspot.checkpoints")


def state_nbytes(state: dict[str, dict]) -> int:
    return sum(t.numel() * t.element_size() for unit in state.values() for t in unit.values() if t is not None)


class TieredSnapshots:
    def __init__(self, s3=None, s3_every: int = 10, keep: int = 3, meta: dict | None = None):
        self.memory = MemorySnapshots()
        self.s3, self.s3_every, self.keep, self.meta = s3, s3_every, keep, meta or {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hetspot-s3") if s3 is not None else None
        self._inflight: Future | None = None
        self.uploads: list[dict] = []  # per S3 upload: step, bytes, seconds, error
        self.last_restore: dict | None = None  # step, tier, bytes of the last latest() that restored

    def save(self, step: int, state: Any, optimizer_steps: float) -> None:
        self.memory.save(step, state, optimizer_steps)
        if self._pool is not None and (step + 1) % self.s3_every == 0:
            self._inflight = self._pool.submit(self._upload, step, state, optimizer_steps)

    def _upload(self, step: int, state: dict, optimizer_steps: float) -> None:
        t0 = time.perf_counter()
        try:
            manifest = self.s3.save(step, state, optimizer_steps, self.meta)
            self.s3.keep_newest(self.keep)
            nbytes = sum(u["bytes"] for u in manifest["units"].values())
            self.uploads.append({"step": step, "bytes": nbytes, "seconds": time.perf_counter() - t0, "error": None})
            log.info("checkpoint step %d in %s: %d bytes in %.2f s", step, self.s3.uri, nbytes, time.perf_counter() - t0)
        except Exception as e:  # an upload failure costs a checkpoint, not the job; it is recorded
            self.uploads.append({"step": step, "bytes": 0, "seconds": time.perf_counter() - t0, "error": str(e)})
            log.warning("checkpoint step %d to %s failed: %s", step, self.s3.uri, e)

    def latest(self) -> tuple[int, Any, float] | None:
        snap = self.memory.latest()
        if snap is not None:
            self.last_restore = {"step": snap[0], "tier": "memory", "bytes": state_nbytes(snap[1])}
            return snap
        if self.s3 is None:
            return None
        from botocore.exceptions import BotoCoreError, ClientError

        from orchestrator.state.s3_store import CheckpointError

        try:
            got = self.s3.load_latest()
        except (BotoCoreError, ClientError) as e:
            raise CheckpointError(f"cannot read checkpoints from {self.s3.uri}: {e}") from None
        if got is None:
            return None
        step, state, optimizer_steps, nbytes = got
        self.last_restore = {"step": step, "tier": "s3", "bytes": nbytes}
        self.memory.save(step, state, optimizer_steps)
        return step, state, optimizer_steps

    def flush(self, timeout_s: float = 300.0) -> None:
        """Wait for the upload in flight (at the end of a job, so its last checkpoint is complete)."""
        if self._inflight is not None:
            self._inflight.result(timeout=timeout_s)
