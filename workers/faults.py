"""Fault injection for drills and tests: fail this rank at step s (torchft's `fail_at(rank, step)`).

A `FaultInjector` lives beside a rank's Engine (the TrainWorker holds one) and is
passed as the engine step's `before` hook, so the engine itself knows nothing
of faults. Kinds:
  - "raise": the step raises RuntimeError("injected fault") (a deterministic worker error);
  - "hang": the rank blocks, so its peers wait in a collective (a stuck or dying peer);
  - "exit": the worker process exits at once (a crash without a Python exception).
"""

from __future__ import annotations

import os
import threading

KINDS = ("raise", "hang", "exit")


class FaultInjector:
    def __init__(self) -> None:
        self.faults: dict[int, str] = {}
        self._release = threading.Event()

    def fail_at(self, step_index: int, kind: str = "raise") -> None:
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} must be one of {', '.join(KINDS)}")
        self.faults[step_index] = kind

    def __call__(self, step_index: int) -> None:
        kind = self.faults.pop(step_index, None)
        if kind == "raise":
            raise RuntimeError("injected fault")
        if kind == "hang":
            self._release.wait(3600)  # until the actor is killed
        elif kind == "exit":
            os._exit(1)
