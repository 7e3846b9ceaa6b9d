"""Preemption notices: the pollers for each cloud's metadata service and Ray's drain, and the fake metadata
server the tests and drills use. What a failure is and what to do about it: orchestrator/control/failure.py;
where a notice becomes a drain: orchestrator/control/drain.py."""
