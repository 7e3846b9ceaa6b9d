"""`LocalGroup`: the worker side of the state plane's calls, in one process over numpy shards (the shipped fake).

Beside `calls.LocalCalls` it lets `TieredState` (tiers.py) snapshot, upload, salvage and restore in unit tests
without a Ray cluster. Each rank of the plan holds every unit of its stage whole (TP 1): one unit per extended
layer (`unit_name`), whose values are a function of the committed step (`values`), so a test checks that a
restore brought back exactly the step it says, from whichever sources it chose.
"""

from __future__ import annotations

import numpy as np

from planner import layout

SHAPE = (2, 3)


def unit_name(layer: int) -> str:
    return f"layer{layer}"


def values(step: int, unit: str) -> dict[str, np.ndarray]:
    """A unit's committed tensors at `step`: distinct per step and unit."""
    base = float(step * 100 + sum(map(ord, unit)))
    p = np.full(SHAPE, base)
    return {"param": p, "exp_avg": p + 0.5, "exp_avg_sq": p + 0.25}


def model_units(num_layers: int) -> dict[str, list[int]]:
    return {unit_name(x): list(SHAPE) for x in range(-1, num_layers + 1)}


class LocalGroup:
    """A plan's workers: `commit(step)` gives every rank its units' values at `step`; the state plane's calls
    (`snapshot`, `hand_over`, `needs`, `load`, `settle_restore`) go to keepers through `calls`."""

    def __init__(self, plan, calls):
        self.plan, self.calls = plan, calls
        self.ranks = layout.ranks(plan)
        assert all(st.tp == 1 for p in plan.pipelines for st in p.stages), "LocalGroup holds whole units (TP 1)"
        self.units = [[unit_name(x) for x in range(a, b)] for _, a, b in layout.rank_spans(plan)]
        self.step: int | None = None
        self.shards: list[dict] = [{} for _ in self.ranks]
        self.holds_state = False
        self.in_place = False  # its ranks hand their state to keepers (the restart path's salvage)

    def commit(self, step: int) -> None:
        self.step, self.holds_state = step, True
        self.shards = [{u: self._shard(values(step, u), step) for u in units} for units in self.units]

    @staticmethod
    def _shard(tensors: dict, step: int) -> dict:
        return tensors | {"slice": tuple((0, n) for n in SHAPE), "shape": SHAPE, "optimizer_steps": float(step + 1)}

    def _alive(self, rank: int) -> bool:
        return self.ranks[rank].node not in self.calls.dead

    def snapshot(self, step: int, keepers: list, pin: bool = False) -> list:
        assert step == self.step
        return [k.put.remote("peer", step, i, self.shards[i], pin) if self._alive(i) else
                self.calls.handle(self, self.ranks[i].node).step.remote() for i, k in enumerate(keepers)]

    def hand_over(self, keepers: list, timeout_s: float = 30.0) -> list[dict | None]:
        return [self.calls.get(k.put.remote("live", self.step, i, self.shards[i])) if k is not None else None
                for i, k in enumerate(keepers)]

    def needs(self) -> list[list[dict]]:
        nbytes = sum(v.nbytes for v in values(0, "x").values())
        return [[{"unit": u, "region": [[0, n] for n in SHAPE], "nbytes": nbytes} for u in units] for units in self.units]

    def load(self, per_rank: list[list], step: int, optimizer_steps: float, s3: tuple | None,
             overlap: bool = True) -> list[dict]:
        out, shards = [], []
        for transfers in per_rank:
            got: dict[str, dict] = {}
            by_tier: dict[str, int] = {}
            for unit, region, keeper, request in transfers:
                (answer,) = self.calls.get(keeper.get_many.remote([request], step, s3))
                if answer.get("error"):
                    return [{"error": answer["error"], "refusal": answer.get("refusal")}]
                full = got.setdefault(unit, {k: np.zeros(SHAPE) for k in ("param", "exp_avg", "exp_avg_sq")})
                idx = tuple(slice(a, b) for a, b in region)
                for k, v in answer["tensors"].items():
                    if v is not None:
                        full[k][idx] = v
                by_tier[answer["tier"]] = by_tier.get(answer["tier"], 0) + answer["bytes"]
            shards.append({u: self._shard(t, step) for u, t in got.items()})
            out.append({"bytes": by_tier, "pull_s": 0.0, "import_s": 0.0})
        self.shards, self.step, self.holds_state = shards, step, True
        return out

    def settle_restore(self, timeout_s: float = 60.0) -> None:
        return None

    def step(self) -> None:  # a call to a rank whose node is gone (LocalHandle raises NodeGone first)
        return None
