"""Preemption: what a failure is (node lost, actor died, timeout, a deterministic error), and later
spot-notice pollers, the fake metadata server and the drain (issue: Recovery, part 2)."""
