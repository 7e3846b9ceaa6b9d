"""A copy lane's thread run late, as the OS runs it on a loaded machine."""

import threading
import time


class LateWake(threading.Event):
    """A ticket's signal whose lane thread the OS runs late: after waking the waiter it stalls (as a descheduled
    thread does on a loaded machine) before going on with its loop."""

    def set(self) -> None:
        super().set()
        time.sleep(0.005)

