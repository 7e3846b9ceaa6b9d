"""Pipeline schedules as pure data: the order in which a stage runs its micro-batches.

Shared by the simulator (planner/simulator.py) and the worker runtime
(workers/engine.py), so the schedule that is costed is the schedule that runs.
"""

from __future__ import annotations


def op_order(stage: int, num_stages: int, num_mb: int, schedule: str = "1f1b") -> list[tuple[str, int]]:
    """The sequence of ("F"|"B", micro-batch) a stage executes.

    1F1B (PipeDream-Flush): stage i runs min(p - i - 1, m) warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards.
    GPipe runs all forwards, then all backwards.
    """
    if schedule == "gpipe":
        return [("F", j) for j in range(num_mb)] + [("B", j) for j in range(num_mb)]
    warm = min(num_stages - stage - 1, num_mb)
    ops = [("F", j) for j in range(warm)]
    for j in range(num_mb - warm):
        ops += [("F", warm + j), ("B", j)]
    ops += [("B", j) for j in range(num_mb - warm, num_mb)]
    return ops
