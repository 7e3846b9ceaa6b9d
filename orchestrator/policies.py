"""Decisions and the pure policies that make them; the controller only executes them.

Ray Train v2's controller does the same: a failure policy returns a decision
dataclass, the controller applies it and logs the cause. No Ray, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.errors import WorkerFailure
from orchestrator.preemption.failures import is_transient


@dataclass(frozen=True)
class Continue:
    pass


@dataclass(frozen=True)
class Replan:
    reason: str


@dataclass(frozen=True)
class Abort:
    reason: str


Decision = Continue | Replan | Abort


def failure_policy(failure: WorkerFailure, restarts: int, max_restarts: int,
                   user_plan: bool = False, replan_user_plan: bool = False) -> Decision:
    """Re-plan after a transient loss while restarts remain; abort on a deterministic error at once.

    A user-supplied plan is replaced by a planner plan only when the user said so
    (`hetspot submit --plan P --replan-on-loss`).
    """
    if not is_transient(failure.kind):
        return Abort(f"{failure} (an error that any plan would hit again: not re-planning)")
    if restarts >= max_restarts:
        return Abort(f"{failure} (gave up after {restarts} re-plans)")
    if user_plan and not replan_user_plan:
        return Abort(f"{failure} (the job runs the plan given with --plan; pass --replan-on-loss to let "
                     "hetspot re-plan on the surviving GPUs)")
    return Replan(str(failure))


@dataclass(frozen=True)
class Candidate:
    """A plan the job could run for its remaining steps, and what moving onto it costs."""

    name: str
    tokens_per_s: float  # the planner's prediction
    migration_bytes: dict[str, int]  # by tier ("live", "peer", "s3"): what the slowest node pulls (nodes pull at once)
    startup_s: float  # placing workers and joining their process group (0 for the plan running now)
    restore_s: float | None = None  # how long the pull holds training, where known (elastic.held_s: the moments
    # come beside the first step); None: every byte before it, `migration_bytes` over each tier's bandwidth


@dataclass(frozen=True)
class ScaleDecision:
    chosen: str
    move: bool
    reason: str
    finish_s: dict[str, float]  # per candidate: migration plus the remaining steps, predicted


def migration_cost_s(c: Candidate, bandwidth: dict[str, float]) -> float:
    """Start-up plus the restore: `restore_s` where known, else each tier's bytes over that tier's bandwidth
    (bytes/s)."""
    if c.restore_s is not None:
        return c.startup_s + c.restore_s
    return c.startup_s + sum(n / bandwidth[t] for t, n in c.migration_bytes.items() if n)


def scale_policy(current: Candidate, candidates: list[Candidate], tokens_left: float,
                 bandwidth: dict[str, float]) -> ScaleDecision:
    """Pick the plan that finishes the remaining tokens soonest, migration included.

    Throughput minus amortized migration cost (Parcae makes this trade on
    homogeneous spot fleets): a faster plan is taken only when its predicted
    gain over the remaining work exceeds what moving onto it costs. Pure.
    """
    finish = {c.name: migration_cost_s(c, bandwidth) + tokens_left / c.tokens_per_s
              for c in [current, *candidates] if c.tokens_per_s > 0}
    best = min(finish, key=finish.get)
    stay = finish.get(current.name, float("inf"))
    if best == current.name:
        others = [c for c in candidates if c.tokens_per_s > current.tokens_per_s]
        if not others:
            return ScaleDecision(current.name, False, "no candidate plan is faster than the running one", finish)
        c = max(others, key=lambda c: c.tokens_per_s)
        gain = tokens_left / current.tokens_per_s - tokens_left / c.tokens_per_s
        return ScaleDecision(current.name, False, f"{c.name}: predicted gain {gain:.1f} s over the remaining work is "
                             f"below its migration cost {migration_cost_s(c, bandwidth):.1f} s", finish)
    return ScaleDecision(best, True, f"{best}: finishes in {finish[best]:.1f} s (migration "
                         f"{finish[best] - tokens_left / next(c for c in candidates if c.name == best).tokens_per_s:.1f} s "
                         f"included) against {stay:.1f} s on the running plan", finish)


def replan_policy(candidates: list[Candidate], tokens_left: float, bandwidth: dict[str, float]) -> ScaleDecision:
    """After a loss the running plan is gone: of the planner's top candidates, the one that finishes soonest.

    Throughput minus amortized migration cost, as `scale_policy`, with no plan to stay on: a
    slightly slower plan that keeps layers where their state already is wins near the end of a run.
    """
    finish = {c.name: migration_cost_s(c, bandwidth) + tokens_left / c.tokens_per_s
              for c in candidates if c.tokens_per_s > 0}
    best = min(finish, key=finish.get)
    fastest = max(candidates, key=lambda c: c.tokens_per_s).name
    why = "also the fastest" if best == fastest else (
        f"{fastest} is faster but finishes at {finish[fastest]:.1f} s with its migration")
    return ScaleDecision(best, True, f"{best}: finishes in {finish[best]:.1f} s, migration included ({why})", finish)


def notice_decision(notices: list, used: set[str], now: float, margin_s: float,
                    copy_s: Callable[[set[str]], float]) -> tuple[bool, list, float] | None:
    """None when no notice concerns the plan's nodes; else (drain?, those notices, seconds left).

    The controller looks at notices at step boundaries, so a drain starts with the step
    in flight already committed and needs only to keep that step off the doomed nodes:
    nothing to copy when other replicas hold their layers, else the state plane copies
    the whole step to keepers off them, each node its own share (`copy_s(doomed)`:
    orchestrator/elastic.py `drain_copy_s`). With less time left than that copy plus
    `margin_s`, the job keeps training and the loss is handled as a failure (recovery)
    instead.
    """
    mine = [n for n in notices if n.node in used]
    if not mine:
        return None
    left = min(n.deadline_s for n in mine) - now
    return left >= margin_s + copy_s({n.node for n in mine}), mine, left
