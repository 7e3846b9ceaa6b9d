"""`MemorySnapshots`: a state plane that copies the whole state through the process that holds it.

It implements the controller's `StatePlane` (orchestrator/control/protocols.py) with the
worker group's `export_state` / `import_state`: the newest snapshot, in memory.
It serves the controller's unit tests and the shipped fakes. On Ray the
controller uses `state.tiers.TieredState` instead, which moves metadata only.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.control.protocols import WorkerGroup


@dataclass
class MemoryRestore:
    """A restore from the snapshot in this process (the StatePlane's report: `step`, `tier`, `as_dict`)."""

    step: int
    tier: str = "memory"
    bytes: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class MemorySnapshots:
    def __init__(self, every: int = 1) -> None:
        self.every = every
        self._latest: tuple[int, Any, float] | None = None

    def after_step(self, group: WorkerGroup, step: int, avoid: Set[str] = frozenset()) -> bool:
        if (step + 1) % self.every:
            return False
        self._save(group, step)
        return True

    def prepare_drain(self, group: WorkerGroup, avoid: set[str]) -> None:  # nothing to start: copies are here
        pass

    def claim(self) -> None:  # nothing shared to write: no writer lock
        pass

    def writer_lost(self) -> str | None:
        return None

    def release(self) -> None:
        pass

    def drain_ready(self) -> bool:
        return True

    def drain(self, group: WorkerGroup, step: int, avoid: set[str]) -> None:
        if self._latest is None or self._latest[0] != step:
            self._save(group, step)

    def _save(self, group: WorkerGroup, step: int) -> None:
        state, optimizer_steps = group.export_state()
        self._latest = (step, state, optimizer_steps)

    def salvage(self, group: WorkerGroup, avoid: Set[str] = frozenset(), step: int | None = None) -> None:
        """Nothing to keep from a failed group: the snapshot is already here."""

    def restore(self, group: WorkerGroup, avoid: Set[str] = frozenset()) -> MemoryRestore | None:
        if self._latest is None:
            return None
        step, state, optimizer_steps = self._latest
        group.import_state(state, optimizer_steps)
        return MemoryRestore(step)

    def suspend(self, group: WorkerGroup, step: int) -> str:
        """The committed step kept in this process, whatever the group does next."""
        if self._latest is None or self._latest[0] != step:
            self._save(group, step)
        return "memory"

    def flush(self) -> None:
        """Nothing is in flight."""

    def upload_lag(self, committed: int) -> None:
        """No S3 tier."""
