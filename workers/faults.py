"""Fault injection for drills and tests: fail this rank at step s (torchft's `fail_at(rank, step)`).

A `FaultInjector` lives beside a rank's Engine (the TrainWorker holds one) and is
passed as the engine step's `before` hook, so the engine itself knows nothing
of faults. Kinds:
  - "raise": the step raises RuntimeError("injected fault") (a deterministic worker error);
  - "hang": the rank blocks, so its peers wait in a collective (a stuck or dying peer);
  - "exit": the worker process exits at once (a crash without a Python exception);
  - "update": the step's optimizer update fails half-way with a collective error (the process lives on, its
    state is no step's: in-place recovery must replace it, never reuse it);
  - "exit-update": the process exits half-way through the step's optimizer update.
The last two fire at the step's commit (`during_update`), after the update has changed the state.
"""

from __future__ import annotations

import os
import threading

KINDS = ("raise", "hang", "exit", "update", "exit-update")
AT_UPDATE = ("update", "exit-update")


class FaultInjector:
    def __init__(self) -> None:
        self.faults: dict[int, str] = {}
        self._release = threading.Event()

    def fail_at(self, step_index: int, kind: str = "raise") -> None:
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} must be one of {', '.join(KINDS)}")
        self.faults[step_index] = kind

    def during_update(self, step_index: int) -> None:
        if self.faults.get(step_index) not in AT_UPDATE:
            return
        if self.faults.pop(step_index) == "update":
            raise RuntimeError("injected fault: connection closed by peer during the update")
        os._exit(1)

    def __call__(self, step_index: int) -> None:
        if self.faults.get(step_index) in AT_UPDATE:
            return
        kind = self.faults.pop(step_index, None)
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "hang":
            self._release.wait(3600)  # until the actor is killed
        elif kind == "exit":
            os._exit(1)
