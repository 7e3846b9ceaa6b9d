"""The controller's part for a job's end, DONE or FAILED: what the job gives back either way (the run's writer
lock, the fleet's demand on the autoscaler, its place in the cluster's queue, the notice pollers on the nodes, a
switch's timeline still open), and why it failed (`error`, and `exit_code`: 2 where the fix is the user's). Like the
other parts it is inherited by control/controller.Controller; its attributes are control/parts.ControllerParts'.
Pure.
"""

from __future__ import annotations

import logging

from orchestrator.control.parts import ControllerParts
from orchestrator.control.states import State

log = logging.getLogger("hetspot.controller")


class Ending(ControllerParts):
    def _done(self) -> State:
        """Every step is committed: the last checkpoint upload completes (from the workers' copies), then every
        worker ends and the job lets go of what it held."""
        self.store.flush()
        self.workers.shutdown()
        self._let_go("the job ended before the switch")
        self._phase("done")
        return State.DONE

    def _fail(self, reason: str, exit_code: int = 1) -> State:
        """The job stops with `reason` (its workers already gone, or never started)."""
        self._let_go(f"the job failed: {reason}")
        self.place.queued_at = None
        self.error, self.exit_code = reason, exit_code
        self._phase("failed")
        log.error("job failed: %s", reason)
        return State.FAILED

    def _taken_over(self, lost: str) -> State:
        """Another job took the run's writer lock: nothing this job trains could be kept, so it stops (exit 2)."""
        self.workers.shutdown()
        self.group = None
        return self._fail(f"{lost}; the job stopped after step {self.progress.committed} (the run goes on in the job "
                          "that took it over)", exit_code=2)

    def _let_go(self, why: str) -> None:
        if self.queue is not None:
            self.queue.leave()
        getattr(self.interruptions, "close", lambda: None)()  # the notice pollers on the nodes
        self._withdraw()
        self.store.release()  # (none held where the claim itself failed)
        self._end_drain(why)
