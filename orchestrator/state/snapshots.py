"""`MemorySnapshots`: the newest canonical state snapshot, in the memory of the process that holds it.

A `CheckpointStore` (orchestrator/protocols.py). The controller keeps only the
snapshot's step in its progress; the tensors live here. It is the single-copy
store the tiered state work replaces; it also serves the controller's unit tests.
"""

from __future__ import annotations

from typing import Any


class MemorySnapshots:
    def __init__(self) -> None:
        self._latest: tuple[int, Any, float] | None = None

    def save(self, step: int, state: Any, optimizer_steps: float) -> None:
        self._latest = (step, state, optimizer_steps)

    def latest(self) -> tuple[int, Any, float] | None:
        return self._latest
