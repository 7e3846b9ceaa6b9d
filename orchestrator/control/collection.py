"""Python's cyclic garbage collector paused over a recovery, from the failure to the new group's restore.

At thousands of ranks a recovery allocates hundreds of thousands of small objects (the re-plan's candidates, the
keepers' inventories, the restore plan's holdings and transfers), and each allocation threshold crossed can run a
collection that walks the controller's whole heap: `bench/control_plane.py` measured 0.4-0.8 s of a 4,096-GPU
recovery's 2.1 s of controller CPU in those collections. Pausing them for the few seconds of a recovery costs only
the cycles made meanwhile staying in memory until collection resumes (the next automatic collection finds them);
reference counting frees everything else as usual. A collector the caller disabled is left as it was."""

from __future__ import annotations

import gc


class CollectionPause:
    def __init__(self) -> None:
        self.paused = False  # this pause disabled the collector (and only then turns it back on)

    def pause(self) -> None:
        if not self.paused and gc.isenabled():
            gc.disable()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            gc.enable()
            self.paused = False
