"""Where a spot notice becomes a drain: whether the deadline leaves time to copy what the doomed nodes hold.

`notice_decision` weighs the notices on the plan's nodes against the time to copy the doomed nodes' state
(`drain_copy_s`, zero when another replica holds their layers: `replicated_off`); the controller starts the
drain when it fits, else falls back to recovery when the node goes. Pure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from orchestrator.control.migration import bandwidths, node_bytes
from planner import ClusterSpec, Plan
from planner.layout import stage_layers
from planner.specs import ModelSpec, TrainSpec


class NoticeDecision(NamedTuple):
    drain: bool  # drain now (the copy fits before the deadline); False: train on, recover when the node goes
    notices: list  # the notices on the plan's nodes
    left_s: float  # seconds to the nearest of their deadlines


def notice_decision(notices: list, used: set[str], now: float, margin_s: float,
                    copy_s: Callable[[set[str]], float]) -> NoticeDecision | None:
    """None when no notice concerns the plan's nodes; else the decision, with those notices and the time left.

    The controller looks at notices at step boundaries, so a drain starts with the step
    in flight already committed and needs only to keep that step off the doomed nodes:
    nothing to copy when other replicas hold their layers, else the state plane copies
    the whole step to keepers off them, each node its own share (`copy_s(doomed)`:
    `drain_copy_s`). With less time left than that copy plus
    `margin_s`, the job keeps training and the loss is handled as a failure (recovery)
    instead.
    """
    mine = [n for n in notices if n.node in used]
    if not mine:
        return None
    left = min(n.deadline_s for n in mine) - now
    return NoticeDecision(left >= margin_s + copy_s({n.node for n in mine}), mine, left)


def replicated_off(p: Plan, doomed: set[str]) -> bool:
    """Whether stages off the `doomed` nodes hold every layer the stages on them hold. A stage's TP ranks share
    one node, so a surviving stage holds whole layers: other replicas then cover everything the doomed nodes hold
    at the committed step (data-parallel replicas hold the same state after each step)."""
    held: set[int] = set()
    needed: set[int] = set()
    for node, layers in stage_layers(p):
        (needed if node in doomed else held).update(layers)
    return needed <= held


def drain_copy_s(p: Plan, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, doomed: set[str]) -> float:
    """Seconds a drain takes to copy the committed step off the `doomed` nodes (state/tiers.py `drain`): none when
    other replicas hold every layer of theirs (`replicated_off`; survivors keep their own state on their own
    node); else the state plane copies every rank's state to keepers off them, each node what its stages hold
    over its own link, at once."""
    if replicated_off(p, doomed):
        return 0.0
    known = {n.name for n in cluster.nodes}
    return max((b / bandwidths(cluster, n if n in known else None)["peer"]
                for n, b in node_bytes(p, model, train).items()), default=0.0)
