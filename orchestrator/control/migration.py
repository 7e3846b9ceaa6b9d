"""What moving onto a plan costs: the bytes each node holds and pulls, and how long the pull holds training.

Each new stage pulls its state from its own node when the running plan held those layers there ("live"),
else from another node ("peer"), over `bandwidths`; nodes pull at once, the weights before the first step and
AdamW's moments beside it (`held_s`). The re-plan and scale-up policies (replan.py), the drain (drain.py) and
the fleet simulator (drills/) charge these figures. Pure: the planner's types and arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from dataclasses import dataclass

from planner import ClusterSpec, Plan
from planner.layout import stage_layers
from planner.specs import ModelSpec, TrainSpec

WEIGHTS_SHARE = 1 / 3  # of the state a restore moves: the master weights; AdamW's two moments are the rest


# S3 per node, read or write: one S3 connection carries about 85-90 MB/s (AWS's S3 performance guidelines: one
# concurrent request per 85-90 MB/s of throughput wanted); a restore reads each piece over 16 connections
# (s3_store.CONNECTIONS), which bench/s3_restore.py measured at 11.0x one connection through a per-connection cap
# (2026-12-06, commit 2be423e, the 2-core CPU test machine: medians of 5): 16 x 87.5 MB/s x 11.0 / 16 = 0.96 GB/s,
# taken as 1 GB/s, and never above the node's link.
S3_NODE_GB_S = 1.0
MOMENTS_SLOWDOWN = 2.0  # the moments share the links with the first step's own traffic: counted at half speed


def layer_bytes(model: ModelSpec, train: TrainSpec, layer: int) -> float:
    """State of one extended layer (-1 embedding, L head) as the tiers move it: master weights and AdamW's moments."""
    params = model.embed_params if layer < 0 else model.head_params if layer >= model.num_layers else model.layer_params
    return params * train.state_bytes_per_param




def node_bytes(p: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, float]:
    """Per node of plan `p`, the state its stages hold (`layer_bytes`)."""
    out: dict[str, float] = {}
    for node, layers in stage_layers(p):
        out[node] = out.get(node, 0.0) + sum(layer_bytes(model, train, x) for x in layers)
    return out


def layer_sources(old: Plan | None, new: Plan, gone: Set[str] = frozenset(), peer_of: dict[str, str] | None = None,
                  ) -> Iterator[tuple[str, int, str, str | None]]:
    """Where each stage of `new` gets each extended layer it holds, as (node, layer, tier, redo): "live" when the
    node itself held the layer in `old` and survived, "peer" when another surviving node held it, or when only
    the peer snapshot of a lost holder survived (`peer_of`: the node keeping each node's snapshot; `redo` is then
    "snapshot"), else "s3" (`redo` "s3"). The one restore-source rule: the controller's migration costs (nothing
    gone) and the fleet simulator's recovery model (nodes gone) both count bytes with it."""
    held: dict[int, list[str]] = {}
    for node, layers in stage_layers(old) if old is not None else ():
        for layer in layers:
            held.setdefault(layer, []).append(node)
    for node, layers in stage_layers(new):
        for layer in layers:
            live = [h for h in held.get(layer, []) if h not in gone]
            if node in live:
                yield node, layer, "live", None
            elif live:
                yield node, layer, "peer", None
            elif peer_of is not None and any(peer_of[h] not in gone for h in held.get(layer, [])):
                yield node, layer, "peer", "snapshot"
            else:
                yield node, layer, "s3", "s3"


def node_migration_bytes(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, dict]:
    """Per node of the new plan, the bytes its stages pull, by tier: "live" where the old plan held the layer
    on that node, else "peer" (another node's live copy or snapshot). Every replica pulls its own. A move always
    has a running plan to pull from (`old` None: every byte counted as "peer")."""
    out: dict[str, dict] = {}
    for node, layer, tier, _ in layer_sources(old, new):
        got = out.setdefault(node, {"live": 0.0, "peer": 0.0})
        got["peer" if tier == "s3" else tier] += layer_bytes(model, train, layer)
    return out


def migration_bytes(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec) -> dict[str, float]:
    """The bytes every node of the new plan pulls together, by tier."""
    out = {"live": 0.0, "peer": 0.0}
    for got in node_migration_bytes(old, new, model, train).values():
        for tier, n in got.items():
            out[tier] += n
    return out


def slowest_pull(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec, bw: dict[str, float]) -> dict:
    """The bytes by tier of the node that pulls longest: nodes pull at once, each over its own link, so
    the migration lasts as long as its slowest node's pull (not the sum over nodes)."""
    per_node = node_migration_bytes(old, new, model, train)
    return max(per_node.values(), key=lambda b: sum(n / bw[t] for t, n in b.items()), default={})


def overlap_window_s(p: Plan) -> float:
    """Seconds of a plan's first step that a restore's moments may arrive in unseen: its forward and backward
    (the fastest replica's); the update waits for them, and the gradient sync is not counted as room."""
    return min(p.estimate.pipeline_time_s, default=0.0) if p.estimate is not None else 0.0


def held_s(pulls: list[tuple[float, float]], window_s: float) -> float:
    """Seconds a restore holds training back. `pulls`: per node, the seconds its weights (and whole S3 pieces)
    take and the seconds its moments take. The first step starts once every node has its weights; each node's
    moments follow on its link (workers/actor.py `load_state`): at full speed until the step starts, at
    1 / MOMENTS_SLOWDOWN beside its forward and backward (`window_s`), at full speed again while its update
    waits for the last of them. Never more than pulling every byte first."""
    if not pulls:
        return 0.0
    first = max(w for w, _ in pulls)
    left = [max(0.0, m - (first - w)) for w, m in pulls]
    return first + max(max(0.0, x - window_s / MOMENTS_SLOWDOWN) for x in left)


def pull_held_s(old: Plan | None, new: Plan, model: ModelSpec, train: TrainSpec, bw: dict[str, float]) -> float:
    """`held_s` of the move from `old` to `new` (`node_migration_bytes`), every node at the bandwidths `bw`."""
    per_node = node_migration_bytes(old, new, model, train).values()
    pulls = [(WEIGHTS_SHARE * t, (1 - WEIGHTS_SHARE) * t) for t in
             (sum(n / bw[tier] for tier, n in got.items()) for got in per_node)]
    return held_s(pulls, overlap_window_s(new))


def bandwidths(cluster: ClusterSpec, node: str | None = None) -> dict[str, float]:
    """Bytes/s per tier: a node's own keeper, another node over the link (the slowest of the cluster, or
    `node`'s own), S3 at most S3_NODE_GB_S."""
    link = (cluster.node(node).inter_node_bw_gb_s if node else min(n.inter_node_bw_gb_s for n in cluster.nodes)) * 1e9
    return {"live": 4 * link, "peer": link, "s3": min(link, S3_NODE_GB_S * 1e9)}


@dataclass(frozen=True)
class Candidate:
    """A plan the job could run for its remaining steps, and what moving onto it costs."""

    name: str
    tokens_per_s: float  # the planner's prediction
    migration_bytes: dict[str, int]  # by tier ("live", "peer", "s3"): what the slowest node pulls (nodes pull at once)
    startup_s: float  # placing workers and joining their process group (0 for the plan running now)
    restore_s: float | None = None  # how long the pull holds training, where known (migration.held_s: the moments
    plan: Plan | None = None  # the Plan itself (None for the running one): a decision carries it, not its name
    moved_bytes: float | None = None  # every node's pull over the network together (peer and S3; a node's own
    # keeper, "live", is not moved): what a movement-aware re-plan minimises (replan.replan_policy)


def migration_cost_s(c: Candidate, bandwidth: dict[str, float]) -> float:
    """Start-up plus the restore: `restore_s` where known, else each tier's bytes over that tier's bandwidth
    (bytes/s)."""
    if c.restore_s is not None:
        return c.startup_s + c.restore_s
    return c.startup_s + sum(n / bandwidth[t] for t, n in c.migration_bytes.items() if n)
