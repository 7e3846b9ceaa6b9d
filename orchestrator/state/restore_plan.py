"""The restore planner: a pure function from (what the new plan needs, what each source holds) to transfers.

A *need* is one rank of the new plan and one canonical unit (a parameter tensor
by name, with its optimizer state): the region of the full tensor that rank
holds under its TP layout. A *holding* is a region of a unit at some step that
a source can hand out (its `origin`, a typed source from workers/transfer.py): a
kept worker process or a node's keeper holding a survivor's state (tier live), a
keeper's peer-memory snapshot (peer), or an S3 object (s3). Regions are per-dimension
[start, stop) ranges of the full, unsharded tensor, so a TP shard of one plan
feeds a different TP layout of another: a need is covered by the union of
pieces along its sharded dimension.

`plan_restore` picks the newest step at which every need is coverable, then
for each need the cheapest pieces: the same worker, then the same node, then
another node (live or peer), and S3 last, so S3 bytes are the least the
holdings allow (AutoHet's local-first recovery; Gemini's peer-memory tier).
`only_tiers={"s3"}` reproduces an S3-only restore of the same state, for
comparison. No Ray, torch or boto3: plain data in, plain data out. The sources' own reports (keepers'
inventories, kept processes' rows, S3 manifests) become Holdings here too (`keeper_holdings`,
`process_holdings`, `s3_holdings`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set
from dataclasses import dataclass, field

from workers.transfer import (
    HeldRow,
    KeeperSource,
    ProcessHolding,
    ProcessSource,
    Region,
    S3Piece,
    S3Source,
    Source,
    Tier,
    region,
)

TIERS = (Tier.LIVE, Tier.PEER, Tier.S3)  # what a restore reads from (in place is the live tier's cheapest class)


@dataclass(frozen=True)
class Need:
    rank: int
    node: str
    unit: str
    region: Region
    nbytes: int  # bytes of the region (all of the unit's tensors)


@dataclass(frozen=True)
class Holding:
    tier: Tier  # live, peer or s3
    origin: Source  # a kept process, a node's keeper, or an S3 object
    node: str | None  # where the bytes are (None for S3)
    unit: str
    region: Region
    step: int
    rank: int | None = None  # for a kept process: its rank in the new plan, if it has one


@dataclass(frozen=True)
class Transfer:
    need: Need
    source: Holding
    region: Region  # the part of the need this source sends
    nbytes: int


@dataclass
class RestorePlan:
    step: int | None  # None: no step has every unit
    transfers: list[Transfer] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # units no source holds at any step (when step is None)

    def bytes_by_tier(self) -> dict[Tier, int]:
        out = Counter({t: 0 for t in TIERS})
        for t in self.transfers:
            out[t.source.tier] += t.nbytes
        return dict(out)

    def report(self) -> dict:
        return {"step": self.step, "bytes_by_tier": self.bytes_by_tier(), "num_transfers": len(self.transfers),
                "missing": self.missing}


def cost_class(need: Need, h: Holding) -> int:
    """0: the same worker already holds it; 1: the same node; 2: another node's memory; 3: S3."""
    if h.tier == Tier.S3:
        return 3
    if h.tier == Tier.LIVE and h.rank == need.rank:
        return 0
    return 1 if h.node == need.node else 2


def _contains(outer: Region, inner: Region, skip: int | None = None) -> bool:
    return len(outer) == len(inner) and all(
        d == skip or (a <= c and d_ >= e) for d, ((a, d_), (c, e)) in enumerate(zip(outer, inner, strict=True)))


def _cover(need: Need, pieces: list[Holding], d: int) -> list[tuple[Holding, tuple[int, int]]] | None:
    """Cheapest pieces covering the need along its sharded dimension `d`, or None.

    Sweep the dimension: at each point take the cheapest class of piece that holds
    it (then the one reaching farthest), and stop using it where a cheaper piece
    begins. So a costly source (S3) sends only what no cheaper source holds.
    """
    if not need.region:
        return None
    usable = [p for p in pieces if _contains(p.region, need.region, skip=d)]
    at, stop = need.region[d]
    out: list[tuple[Holding, tuple[int, int]]] = []
    while at < stop:
        here = [p for p in usable if p.region[d][0] <= at < p.region[d][1]]
        if not here:
            return None
        p = min(here, key=lambda p: (cost_class(need, p), -p.region[d][1], p.tier != Tier.LIVE))
        cheaper_starts = [q.region[d][0] for q in usable
                          if at < q.region[d][0] < p.region[d][1] and cost_class(need, q) < cost_class(need, p)]
        end = min([p.region[d][1], stop, *cheaper_starts])
        if out and out[-1][0] is p:  # extend the previous stretch of the same source
            out[-1] = (p, (out[-1][1][0], end))
        else:
            out.append((p, (at, end)))
        at = end
    return out


def _transfers(need: Need, cover: list[tuple[Holding, tuple[int, int]]], d: int) -> list[Transfer]:
    """The cover as transfers: each stretch along `d` (the dimension the cover was swept along: the cover's
    own pieces may all match the need there, e.g. a piece that is exactly the need) with the need's other
    extents."""
    length = need.region[d][1] - need.region[d][0]
    out = []
    for h, (a, b) in cover:
        region = tuple((a, b) if i == d else r for i, r in enumerate(need.region))
        out.append(Transfer(need, h, region, need.nbytes * (b - a) // length))
    return out


class _Group:
    """One unit's holdings at one step with the same region and tier, in the holdings' order (`pieces`: (index,
    holding) pairs). Its pieces differ for a need only in their cost class (0: the need's rank, 1: its node, 2:
    another node, 3: S3), so the one `_cover` could pick is the first of the best class the group has for that
    need: the first with the need's rank, else the first on its node, else the first of all (of another node then;
    for S3, of any)."""

    def __init__(self, pieces: list[tuple[int, Holding]]) -> None:
        self.first = pieces[0]
        self.by_node = {h.node: (i, h) for i, h in reversed(pieces)}  # the first on each node
        self.by_rank = {h.rank: (i, h) for i, h in reversed(pieces)  # the first of each rank (class 0: cost_class)
                        if h.rank is not None and h.tier == Tier.LIVE}

    def pick(self, need: Need) -> tuple[int, Holding]:
        return self.by_rank.get(need.rank) or self.by_node.get(need.node) or self.first


class _Index:
    """One unit's holdings at one step, grouped by (region, tier) so that a need's cover looks at one piece per
    group instead of every replica's (at thousands of ranks a unit has thousands of holders: the sweep over all of
    them for every need grew with the square of the ranks). `candidates(need)` keeps the holdings' order, so the
    cover is the one the sweep over every piece gives."""

    def __init__(self, pieces: list[Holding]) -> None:
        by_key: dict[tuple[Region, Tier], list[tuple[int, Holding]]] = {}
        for i, h in enumerate(pieces):
            by_key.setdefault((h.region, h.tier), []).append((i, h))
        self.groups = {key: _Group(ps) for key, ps in by_key.items()}
        self.regions = list(dict.fromkeys(r for r, _ in self.groups))  # distinct, in first-appearance order
        self._fits: dict[tuple[Region, int], list[_Group]] = {}  # by (a need's region, d): the groups it can use
        self.own: dict[int, list[tuple[int, Holding]]] = {}  # by rank: its kept process's own pieces (class 0)
        for g in self.groups.values():
            for rank, piece in g.by_rank.items():
                self.own.setdefault(rank, []).append(piece)

    def in_place(self, need: Need) -> Holding | None:
        """The rank's own kept piece that holds the whole need, if one does: then it alone is the cover (nothing is
        cheaper than reading in place, and the sweep takes it from start to end), without looking at the others.
        Most needs of a recovery in place are this one (a survivor keeping its layers)."""
        whole = [(i, h) for i, h in self.own.get(need.rank, ()) if _contains(h.region, need.region)]
        if len(whole) > 1:  # the sweep's choice among them: the one reaching farthest along d, then the first
            d = _shard_dim(need, self.regions)
            whole.sort(key=lambda ih: (-ih[1].region[d][1], ih[0]))
        return whole[0][1] if whole else None

    def candidates(self, need: Need, d: int) -> list[Holding]:
        """The pieces `_cover` could use for `need` along `d`: per group whose region holds the need's extent in the
        other dimensions and meets it along `d` (no other piece can be swept over), the one it would pick."""
        if not need.region:
            return []
        key = (need.region, d)
        fits = self._fits.get(key)
        if fits is None:  # the many ranks needing the same slice (replicas, TP peers) share the regions' test
            a, b = need.region[d]
            fits = self._fits[key] = [g for (r, _), g in self.groups.items()
                                      if r[d][0] < b and a < r[d][1] and _contains(r, need.region, skip=d)]
        return [h for _, h in sorted(g.pick(need) for g in fits)]


def _shard_dim(need: Need, regions: list[Region]) -> int:
    """The dimension along which the pieces' regions split the unit (a canonical unit is sharded on at most one):
    the first dimension in which one of them differs from the need's."""
    for r in regions:
        for d, (a, b) in enumerate(r):
            if (a, b) != need.region[d]:
                return d
    return 0


def _plan_at(step: int, needs: list[Need], by_unit: dict[str, dict[int, _Index]]) -> list[Transfer] | None:
    """Transfers restoring every need at `step`, cheapest class first; None if some need is not coverable."""
    out = []
    empty = _Index([])
    for need in needs:
        index = by_unit.get(need.unit, {}).get(step, empty)
        own = index.in_place(need) if need.region else None
        if own is not None:
            out.append(Transfer(need, own, need.region, need.nbytes))
            continue
        d = _shard_dim(need, index.regions)
        cover = _cover(need, index.candidates(need, d), d)
        if cover is None:
            return None
        out += _transfers(need, cover, d)
    return out


def plan_restore(needs: list[Need], holdings: list[Holding], only_tiers: Set[str] | None = None) -> RestorePlan:
    """The newest step at which every need is available, and the cheapest transfers for it."""
    if only_tiers is not None:
        holdings = [h for h in holdings if h.tier in only_tiers]
    pieces: dict[str, dict[int, list[Holding]]] = {}
    for h in holdings:
        pieces.setdefault(h.unit, {}).setdefault(h.step, []).append(h)
    by_unit = {u: {step: _Index(hs) for step, hs in steps.items()} for u, steps in pieces.items()}
    for step in sorted({h.step for h in holdings}, reverse=True):
        got = _plan_at(step, needs, by_unit)
        if got is not None:
            return RestorePlan(step, got)
    return RestorePlan(None, [], sorted({n.unit for n in needs} - set(by_unit)))


def peer_placement(ranks: list[tuple[str, int, int]], candidates: list[str], nbytes: list[int]) -> list[str]:
    """Where each rank's peer snapshot goes: a node of `candidates`, one per rank.

    `ranks[i]` is (node, first, end) of rank i's extended layer range. Each rank's
    snapshot goes, in order of preference, to a node that holds none of its layers
    live (so losing any two nodes rarely takes every copy), else to any node but
    its own (so losing one node never does), else its own; among those, the node
    with the fewest bytes placed so far. Pure: plain data in, node names out.
    """
    load = dict.fromkeys(candidates, 0)
    out = []
    for (node, a, b), n in zip(ranks, nbytes, strict=True):
        live = {m for m, c, d in ranks if c < b and a < d}
        tiers = ([c for c in candidates if c not in live], [c for c in candidates if c != node], list(candidates))
        pick = min(next(t for t in tiers if t), key=lambda c: (load[c], c))
        load[pick] += n
        out.append(pick)
    return out


def keeper_holdings(inventory: dict[str, list[HeldRow]], tiers: tuple[Tier, ...] = TIERS, step: int | None = None,
                    ) -> tuple[list[Holding], dict[int, float], dict[str, list[int]]]:
    """(Holdings, optimizer steps by step, unit shapes) from {node: the keeper's inventory rows}."""
    holdings: list[Holding] = []
    opt: dict[int, float] = {}
    shapes: dict[str, list[int]] = {}
    for node, rows in inventory.items():
        for row in rows:
            if row.tier not in tiers or (step is not None and row.step != step):
                continue
            holdings.append(Holding(row.tier, KeeperSource(node, row.tier, row.rank), node, row.unit,
                                    region(row.region), row.step))
            shapes[row.unit] = list(row.shape)
            opt[row.step] = row.optimizer_steps
    return holdings, opt, shapes


def process_holdings(held: list[ProcessHolding]) -> tuple[list[Holding], dict[int, float]]:
    """(Holdings, optimizer steps by step) from the state kept in worker processes (in-place recovery). A
    process's own rank reads it in place (the restore planner's cost class 0)."""
    holdings, opt = [], {}
    for i, p in enumerate(held):
        origin = ProcessSource(p.node, i, p.rank, p.handle)
        for row in p.rows:
            holdings.append(Holding(Tier.LIVE, origin, p.node, row.unit, region(row.region), row.step, p.rank))
            opt[row.step] = row.optimizer_steps
    return holdings, opt


def s3_holdings(manifests: list[dict]) -> tuple[list[Holding], dict[int, float]]:
    """(Holdings, optimizer steps by step) from complete S3 steps' manifests."""
    holdings: list[Holding] = []
    opt: dict[int, float] = {}
    for m in manifests:
        opt[m["step"]] = float(m["optimizer_steps"])
        for unit, u in m["units"].items():
            for entry in u["pieces"]:
                piece = S3Piece.of(entry)
                holdings.append(Holding(Tier.S3, S3Source(piece), None, unit, piece.region, m["step"]))
    return holdings, opt
