"""The controller's part for its fleet's capacity (control/capacity.Capacity decides the demand; this part waits on
it and names what it changed). Pure."""

from __future__ import annotations

import logging

from orchestrator.control.capacity import Capacity, CapacityView, timeout_message
from orchestrator.control.parts import ControllerParts
from orchestrator.control.states import Phase, State, present

log = logging.getLogger("hetspot.controller")


class WatchingCapacity(ControllerParts):
    """The controller's part for its fleet's capacity (control/controller.Controller inherits it; its attributes:
    control/parts.ControllerParts): WAITING until every type's minimum is up, the substitutions and re-choices
    named as events while the job runs, and the demand withdrawn at the job's end."""

    def _wait_for_capacity(self, st: State) -> Phase:
        """One look at the fleet against its minimums; the demand is (re)stated when it changed."""
        capacity = present(self.capacity, "fleet's capacity is watched", self.state)
        view = capacity.tick()
        self._substitutions(capacity, view)
        if view.ready:
            log.info("capacity: %s", view.line)
            return State.DISCOVERING
        if capacity.timed_out():
            return self._fail(timeout_message(capacity.fleet, view), exit_code=2)
        self._phase(f"waiting for capacity: {view.line}")
        self.sleep(capacity.fleet.poll_s)
        return State.WAITING

    def _substitutions(self, capacity: Capacity, view: CapacityView) -> None:
        if view.rechosen is not None:
            self._event("rechoose", f"{view.rechosen} stayed short of its nodes for "
                        f"{capacity.fleet.substitute_after_s:.0f} s: chose the fleet again among what is left: "
                        + ", ".join(f"{n}x {t}" for t, n in view.demand.items() if n),
                        dry=view.rechosen, fleet=dict(view.demand))
        for dry, sub, n in view.substituted:
            self._event("substitute", f"{dry} stayed short of its max_nodes for "
                        f"{capacity.fleet.substitute_after_s:.0f} s: asking for {n} {sub} node(s) instead",
                        dry=dry, substitute=sub, nodes=n)

    def _withdraw(self) -> None:  # the job's demand goes, so the autoscaler can scale its GPU nodes down
        if self.capacity is not None and self.capacity.withdraw is not None:
            try:
                self.capacity.withdraw()
            except Exception as e:  # the job's outcome stands; an idle node costs money, so say so
                log.warning("could not withdraw the demand for GPU nodes (%s): scale them down by hand", e)
