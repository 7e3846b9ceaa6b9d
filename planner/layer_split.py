"""One candidate pipeline: its layer split (dynamic programming) and its step time for n samples.

The split follows AutoHet/HexiScale: stages are given in order (each a TP group
of one GPU type on one node), and a DP over (stage, layers covered) picks the
contiguous boundaries minimizing the slowest stage's per-step cost
m * (fwd + bwd) + optimizer time, ties broken by the sum of per-micro-batch stage
times (the 1F1B fill). Each stage's cost already includes its cheapest fitting
offload policy (planner/offload_policy.py), so memory shapes the split as much
as speed. The split depends only on the pipeline's hardware; gradient sync, which
depends on the other replicas, is added when the finish time is computed.

For speed at the keyboard: a stage's costs for every layer count come from one
numpy pass (offload_policy.fitting_by_layers, equal to the scalar cost model to
the bit), and the DP's state after each stage is kept in a trie shared by the
search's pipelines, so the stage orders `best_order` tries compute their common
prefixes once.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from planner import cost
from planner.offload_policy import _MODES, cheapest, cheapest_by_layers, fitting_by_layers, fitting_policies
from planner.specs import ModelSpec, TrainSpec

# A gradient sync's bandwidth (bytes/s) as the search costs it: one for every sync group (outside exact mode), one per
# sync group in the order of `SetCost.link_vector` (planner/scoring.py: embedding, layer 0, ..., layer L-1, LM head),
# or such a vector per stage (`SetCost._best_response`: the links each stage's node would give the groups).
Links = tuple[float, ...]
SyncBw = float | Links | tuple[Links, ...]


def stage_links(sync_bw: SyncBw, i: int) -> float | Links:
    """Stage i's bandwidths: the one for every group, or its vector per sync group."""
    if isinstance(sync_bw, tuple) and isinstance(sync_bw[0], tuple):
        return cast(tuple[Links, ...], sync_bw)[i]
    return cast("float | Links", sync_bw)


@dataclass(frozen=True)
class StageChoice:
    num_layers: int
    policy: cost.Knobs
    times: cost.StageTimes


class _Vector:
    """A stage kind's cheapest choice (`choices`), per-step cost (`val`, inf where nothing fits) and fwd + bwd time
    (`t`) by layer count, for 1..`done` layers; `full`: nothing fits past `done`. Filled once, for every count."""

    __slots__ = ("choices", "val", "t", "done", "full")

    def __init__(self, num_layers: int):
        self.choices: _Choices | None = None
        self.val, self.t = np.full(num_layers + 1, np.inf), np.zeros(num_layers + 1)
        self.done, self.full = 0, False


class _Choices:
    """A vector's StageChoice by layer count, made when a split reads it (a few of a vector's counts): the policy
    the vector chose (`mode` into _MODES, `rec` recomputed layers) with cost.stage_times at the stage's links,
    the figures the vector was computed from (to the bit)."""

    __slots__ = ("mode", "rec", "where", "made")

    def __init__(self, mode: np.ndarray, rec: np.ndarray, where: tuple):
        self.mode, self.rec = mode.astype(np.int8), rec.astype(np.int32)  # index x: x + 1 layers
        self.where = where  # (slot, model, train, first, last, b, inflight, next link, previous link)
        self.made: dict[int, StageChoice] = {}

    def __getitem__(self, n: int) -> StageChoice:
        got = self.made.get(n)
        if got is None:
            slot, model, train, first, last, b, k, nxt, prev = self.where
            opt, params = _MODES[int(self.mode[n - 1])]
            kn = cost.Knobs(int(self.rec[n - 1]), opt, params)
            times = cost.stage_times(slot, model, train, _shape(n, first, last), b, k, kn, nxt, prev)
            got = self.made[n] = StageChoice(n, kn, times)
        return got


DP_STATE_BYTES = 40e6  # what a search's shared DP states may hold (a fleet search of gpt-350m keeps 36k, ~35 MB)


class _DPState:
    """The layer-split DP after some stages: best (max stage cost, sum of times) per layers covered, the start
    each came from, the last stage's choices by layer count, and the state before it. Hashed by identity: the
    search's trie keys a state's successors by (state, next stage's hardware, its links)."""

    __slots__ = ("prim", "sec", "back", "choices", "parent")

    def __init__(self, prim: np.ndarray, sec: np.ndarray, back: np.ndarray | None, choices: _Choices | None,
                 parent: _DPState | None):
        self.prim, self.sec, self.back, self.choices, self.parent = prim, sec, back, choices, parent


@dataclass(frozen=True)
class Finish:
    time_s: float
    micro_batch_size: int
    num_micro_batches: int
    stages: tuple[StageChoice, ...]


class PipelineModel:
    def __init__(
        self, slots: list[cost.Slot], model: ModelSpec, train: TrainSpec, exact: bool,
        schedule: str = "1f1b", stage_cache: dict | None = None, profile: tuple[int, ...] | None = None,
    ):
        self.slots, self.model, self.train, self.exact, self.schedule = slots, model, train, exact, schedule
        # Per-stage TP across replicas: `profile` gives every layer's TP degree, and a stage of degree t may only
        # take layers of degree t (so every replica gives a layer the same degree). Exact mode only.
        if profile is not None and not exact:
            raise ValueError("a TP profile needs exact mode")
        self.profile = profile
        # The embedding and the LM head may each get a stage of no transformer layers where the vocabulary is
        # large next to a layer (a T4 pipeline of a 50k-vocab model: its head alone outweighs a few layers).
        self.edges = len(slots) >= 2 and edge_stages_may_win(model)
        self.homogeneous = len({(s.gpu_type, s.tp, s.mem_cap_bytes, s.flops_per_gpu) for s in slots}) == 1
        self.p2p = cost.stage_links(slots)
        # Shared across pipelines of one search: the same hardware at the same position costs the same.
        self._stage_cache = {} if stage_cache is None else stage_cache
        self._hw = [cost.hardware_id(s) for s in slots]  # the same hardware on any node costs the same
        self._splits: dict[tuple[int, int], tuple[StageChoice, ...] | None] = {}
        self._again: dict[tuple[int, int], tuple[StageChoice, ...]] = {}  # (id(split), m) -> _policies_at's
        self._finish: dict[tuple, Finish | None] = {}
        self._parts: dict[tuple[int, int, int, int], tuple[float, list[tuple[float, float, float]]]] = {}
        self._times: dict[tuple[int, int, int], cost.StageTimes] = {}
        self._consts: dict[int, list[tuple]] = {}
        self._syncs: dict[tuple, float] = {}

    def _shape(self, i: int, n: int) -> cost.StageShape:
        return _shape(n, i == 0, i == len(self.slots) - 1)

    def _candidates(self, i: int, n: int, b: int, k: int) -> list[tuple[cost.Knobs, cost.StageTimes]]:
        first, last = i == 0, i == len(self.slots) - 1
        key = (self._hw[i], n, first, last, k, self.p2p[i], b)
        got = self._stage_cache.get(key)
        if got is None:
            # What fits and its compute do not depend on the links: costed once, each position's sends added.
            base_key = ("unlinked", self._hw[i], n, first, last, k, b)
            base = self._stage_cache.get(base_key)
            if base is None:
                base = self._stage_cache[base_key] = fitting_policies(self.slots[i], self.model, self.train,
                                                                      _shape(n, first, last), b, k, None, None)
            nxt, prev = self.p2p[i]
            got = self._stage_cache[key] = [(kn, cost.with_links(t, self.model, self.train, b, nxt, prev))
                                            for kn, t in base]
        return got

    def _grow(self, i: int, b: int, m: int) -> _Vector:
        """Stage i's vector, shared by every pipeline of the search with the same hardware and links at a position
        of the same kind (pipelines of every depth read the same one)."""
        p = len(self.slots)
        k = cost.inflight(i, p, m, self.schedule)
        key = ("vector", self._hw[i], i == 0, i == p - 1, k, self.p2p[i], b, m)
        v = self._stage_cache.get(key)
        if v is None:
            v = self._stage_cache[key] = _Vector(self.model.num_layers)
        if v.choices is None:  # every count at once: one numpy pass costs what growing it by a layer would
            slot, (nxt, prev), top = self.slots[i], self.p2p[i], self.model.num_layers
            fkey = ("fitting", self._hw[i], i == 0, i == p - 1, k, b)  # what fits does not depend on links or m
            fitting = self._stage_cache.get(fkey)
            if fitting is None:
                fitting = self._stage_cache[fkey] = fitting_by_layers(slot, self.model, self.train, i == 0, i == p - 1,
                                                                      b, k, top)
            mode, rec, fwd, bwd, mem, val = cheapest_by_layers(fitting, slot, self.model, self.train, b, m, nxt, prev)
            t = fwd + bwd
            v.choices = _Choices(mode, rec, (slot, self.model, self.train, i == 0, i == p - 1, b, k, nxt, prev))
            none = np.flatnonzero(mode == -1)
            cut = int(none[0]) if len(none) else top  # a layer more only needs more memory: nothing larger fits
            for x in np.flatnonzero(mode[:cut] == -2).tolist():  # left to the scalar search by the closed form
                n = x + 1
                best = cheapest(self._candidates(i, n, b, k), slot, self.model, self.train, self._shape(i, n), m)
                if best is None:
                    cut = x
                    break
                v.choices.made[n] = StageChoice(n, best[0], best[1])
                val[x], t[x] = best[2], best[1].fwd_s + best[1].bwd_s
            v.val[1:cut + 1], v.t[1:cut + 1] = val[:cut], t[:cut]
            v.done, v.full = cut, cut < top
        return v

    def split(self, b: int, m: int) -> tuple[StageChoice, ...] | None:
        """Best contiguous layer split for micro-batches of b, m per step (None if nothing fits)."""
        p = len(self.slots)
        # Outside exact mode one split per micro-batch size, costed at m = p: the most
        # in-flight activations a 1F1B stage holds, so the split fits for any m.
        m_key = m if self.exact else p
        if (b, m_key) not in self._splits:
            if self.homogeneous and not self.exact:  # each range's DP with its own cap on a stage's layers
                found = [got for lo, hi in self._layer_ranges() if (got := self._dp(b, m_key, lo, hi)) is not None]
            else:
                found = self._shared_dp(b, m_key)
            self._splits[(b, m_key)] = min(found, key=lambda f: f[0])[1] if found else None
        return self._splits[(b, m_key)]

    def _layer_ranges(self) -> list[tuple[int, int]]:
        return [(lo, hi) for lo, hi in edge_ranges(len(self.slots), self.edges) if hi - lo <= self.model.num_layers]

    def _empty_stage(self, i: int, b: int, m: int) -> tuple[StageChoice, float] | None:
        """Stage i with no transformer layer (the embedding alone, or the LM head): its cheapest policy and
        that policy's per-step cost."""
        p = len(self.slots)
        k = cost.inflight(i, p, m, self.schedule)
        key = ("empty", self._hw[i], i == 0, i == p - 1, k, self.p2p[i], b, m)  # as a vector's key: shared alike
        got = self._stage_cache.get(key, False)
        if got is False:
            best = cheapest(self._candidates(i, 0, b, k), self.slots[i], self.model, self.train, self._shape(i, 0), m)
            got = self._stage_cache[key] = None if best is None else (StageChoice(0, best[0], best[1]), best[2])
        return got

    def _shared_dp(self, b: int, m: int) -> list[tuple[tuple, tuple[StageChoice, ...]]]:
        """`_dp` for every layer range of the pipeline (`_layer_ranges`, in that order), from DP states shared
        across the search: the state after a stage depends only on the stages before it (their hardware and
        links) and on the band, so pipelines that begin alike (the stage orders `best_order` tries, one pipeline
        with and without a head-only stage) compute their common prefix once. The ranges that start at one
        stage share one band, wide enough for the shortest of them: a wider band adds only starts that cannot
        end where the narrower one ends, so each range's optimum and its ties are those of its own `_dp`."""
        num_layers, out = self.model.num_layers, {}
        by_lo: dict[int, list[int]] = {}
        for lo, hi in self._layer_ranges():
            by_lo.setdefault(lo, []).append(hi)
        for lo, his in by_lo.items():
            w = num_layers - min(his) + lo + 1
            states = self._dp_states(b, m, lo, max(his) - lo, w)
            for hi in his:
                out[(lo, hi)] = self._read_dp(states[hi - lo - 1], b, m, lo, hi)
        return [got for r in self._layer_ranges() if (got := out[r]) is not None]

    def _dp_states(self, b: int, m: int, lo: int, depth: int, w: int) -> list[_DPState]:
        """The DP states after stages lo .. lo + depth - 1 (band width w), from the search's shared trie."""
        cache, num_layers = self._stage_cache, self.model.num_layers
        root_key = ("dp-root", b, m, len(self.slots), lo, w)
        st = cache.get(root_key)
        if st is None:
            prim = np.full(num_layers + num_layers + 2, np.inf)  # a column past the last layer: the longer
            prim[num_layers] = 0.0  # range's last band; columns from num_layers on (_band_step's layout)
            st = cache[root_key] = _DPState(prim, np.zeros(num_layers + num_layers + 2), None, None, None)
        states = []
        for i in range(depth):
            x = lo + i
            key = (st, self._hw[x], self.p2p[x])  # with the root's (b, m, lo, w) and the depth: the stage's vector
            nxt = cache.get(key)
            if nxt is None:
                v = self._grow(x, b, m)
                prim, sec, start = _band_step(st.prim, st.sec, num_layers, i, w, v.val, v.t, min(w, v.done), False)
                back = start + i
                nxt = _DPState(prim, sec, back, v.choices, st)
                kept = cache.get("dp-bytes", 0)
                if kept < DP_STATE_BYTES:  # past it, states are computed as they are needed and not kept
                    cache[key], cache["dp-bytes"] = nxt, kept + prim.nbytes + sec.nbytes + back.nbytes + 400
            states.append(nxt)
            st = nxt
        return states

    def _read_dp(self, st: _DPState, b: int, m: int, lo: int, hi: int) -> tuple[tuple, tuple[StageChoice, ...]] | None:
        """Range [lo, hi)'s split from the state after its last stage: as `_dp` returns it."""
        num_layers = self.model.num_layers
        if not np.isfinite(st.prim[num_layers + num_layers]):
            return None
        empty = self._empty_stages(b, m, lo, hi)
        if empty is None:
            return None
        edges, edge_val = [e for e, _ in empty], [v for _, v in empty]
        worst = max([float(st.prim[num_layers + num_layers]), *edge_val])
        total = float(st.sec[num_layers + num_layers]) + sum(e.times.fwd_s + e.times.bwd_s for e in edges)
        out, j = [], num_layers
        for i in range(hi - lo - 1, -1, -1):
            assert st.back is not None and st.choices is not None and st.parent is not None, "a stage's state"
            a = int(st.back[j - i - 1])
            out.append(st.choices[j - a])
            j = a
            st = st.parent
        return (worst, total), tuple(edges[:lo]) + tuple(reversed(out)) + tuple(edges[lo:])

    def _empty_stages(self, b: int, m: int, lo: int, hi: int) -> list[tuple[StageChoice, float]] | None:
        """The stages outside [lo, hi) with no transformer layer, each with its cost; None if one fits nothing."""
        got = [self._empty_stage(i, b, m) for i in [*range(lo), *range(hi, len(self.slots))]]
        empty = [e for e in got if e is not None]
        return empty if len(empty) == len(got) else None

    def _dp(self, b: int, m: int, lo: int, hi: int) -> tuple[tuple, tuple[StageChoice, ...]] | None:
        """Lexicographic min-max DP over (stage, layers covered), vectorized with numpy, for stages lo..hi-1
        holding every layer (the stages outside hold none). Returns ((max stage cost, sum of stage times),
        the split) or None.

        A stage's cost depends only on its position and its layer count, so each
        stage contributes a cost vector over layer counts and one DP step is a
        max/plus over an (start, end) matrix.
        """
        empty = self._empty_stages(b, m, lo, hi)
        if empty is None:
            return None
        edges, edge_val = [e for e, _ in empty], [v for _, v in empty]
        p, num_layers = hi - lo, self.model.num_layers
        big = np.inf
        # Stage i can only start at layers i..i+w-1 and end at i+1..i+w (every stage takes at least one layer),
        # so each DP step is a w x w band, w = L - p + 1: narrow for deep pipelines.
        w = num_layers - p + 1
        prim = np.full(num_layers + num_layers + 1, big)  # columns from num_layers on (_band_step's layout)
        prim[num_layers] = 0.0
        sec = np.zeros(num_layers + num_layers + 1)
        backs: list[np.ndarray] = []
        choices_by_stage: list[_Choices] = []
        for i in range(p):
            most = num_layers - (p - 1 - i) - i  # most layers stage i can take
            if self.homogeneous and not self.exact:
                most = min(most, 2 * math.ceil(num_layers / p) + 1)  # a balanced split never goes past 2x
            v = self._grow(lo + i, b, m)
            prim, sec, start = _band_step(prim, sec, num_layers, i, w, v.val, v.t, min(w, most, v.done), i == p - 1)
            backs.append(start + i)
            assert v.choices is not None, "a grown vector has its choices"
            choices_by_stage.append(v.choices)
        if not np.isfinite(prim[num_layers + num_layers]):
            return None
        out, j = [], num_layers
        for i in range(p - 1, -1, -1):
            a = int(backs[i][j - i - 1])
            out.append(choices_by_stage[i][j - a])
            j = a
        worst = max([float(prim[num_layers + num_layers]), *edge_val])
        total = float(sec[num_layers + num_layers]) + sum(e.times.fwd_s + e.times.bwd_s for e in edges)
        return (worst, total), tuple(edges[:lo]) + tuple(reversed(out)) + tuple(edges[lo:])

    # -- time for n samples --------------------------------------------------
    def _mb_candidates(self, n: int) -> list[int]:
        cap = min(n, self.train.max_micro_batch_size)
        if self.exact:
            return list(range(1, cap + 1))
        out = {1 << e for e in range(cap.bit_length()) if (1 << e) <= cap}
        out.add(cap)
        return sorted(out)

    def finish(self, n: int, num_replicas: int = 1, sync_bw: SyncBw = 1.0) -> Finish | None:
        """Fastest (micro-batch size, split) for n samples: the slowest device's finish time. A tuple of
        bandwidths per sync group (see `_stage_options`) is for exact mode only."""
        key = (n, num_replicas, sync_bw)
        if key in self._finish:
            return self._finish[key]
        if self.exact:
            tried = [self._exact_finish(n, b, num_replicas, sync_bw) for b in self._mb_candidates(n)]
            found = [f for f in tried if f is not None]
            self._finish[key] = min(found, key=lambda f: f.time_s) if found else None
            return self._finish[key]
        one_bw = cast(float, sync_bw)  # outside exact mode one bandwidth for every sync group
        best, worse = None, 0
        for b in self._mb_candidates(n):
            m = math.ceil(n / b)
            stages = self.split(b, m)
            if stages is None:
                if best is not None and not self.exact:
                    break  # larger micro-batches only need more memory
                continue
            t = self._time(stages, n, b, m, num_replicas, one_bw)
            again = self._policies_at(stages, b, m)
            if again is not stages:
                t_again = self._time(again, n, b, m, num_replicas, one_bw)
                if t_again < t:
                    stages, t = again, t_again
            if best is None or t < best.time_s * (1 - 1e-12):
                best, worse = Finish(t, b, m, stages), 0
            elif not self.exact:
                worse += 1
                if worse == 2:  # past the sweet spot between GEMM efficiency and bubble
                    break
        self._finish[key] = best
        return best

    def _policies_at(self, stages: tuple[StageChoice, ...], b: int, m: int) -> tuple[StageChoice, ...]:
        """A one-stage pipeline's stage with its policy chosen again at the m micro-batches it runs (the split
        was costed at m = p = 1). An offload's transfers are paid once a step while compute grows with m, so
        at m = 1 parameter offload was priced as if no micro-batch hid it, and the planner took a slower
        policy: it lost to data-parallel+offload by up to 5% (gpt-350m on one L4, micro-batch 16 with
        offload against 8 without). The candidates are those the split chose from, so whatever is chosen
        fits. Returns `stages` itself when nothing changes.

        Deeper pipelines keep the policies costed at m = p: re-choosing there too moved the sample
        allocator's seed and settled one heterogeneity case 1.1% slower (bench/planner.py, 13b on H100 +
        L40S + RTX4090), while it recovered only 3 more of the 49 losses to a baseline in a sweep of small
        clusters (`python bench/planner.py --baseline-sweep`)."""
        p = len(self.slots)
        if p > 1 or m <= p:
            return stages
        key = (id(stages), m)
        got = self._again.get(key)
        if got is None:
            out = []
            for i, ch in enumerate(stages):
                k = cost.inflight(i, p, p, self.schedule)
                skey = ("again", self._hw[i], i == 0, i == p - 1, k, self.p2p[i], b, ch.num_layers, m)
                best = self._stage_cache.get(skey)  # shared by every pipeline with this hardware at such a stage
                if best is None:
                    best = self._stage_cache[skey] = cheapest(
                        self._candidates(i, ch.num_layers, b, k), self.slots[i], self.model, self.train,
                        self._shape(i, ch.num_layers), m)
                out.append(ch if best is None or best[0] == ch.policy else StageChoice(ch.num_layers, best[0], best[1]))
            got = tuple(out) if any(o is not c for o, c in zip(out, stages, strict=True)) else stages
            self._again[key] = got  # kept alive: _stage_consts caches by id
        return got

    def _stage_options(self, i: int, a: int, nl: int, b: int, last_b: int, m: int, num_replicas: int,
                       sync_bw: SyncBw) -> tuple[list[tuple], float]:
        """Every fitting policy of stage i with layers [a, a + nl), as (choice, t full mb, t last mb, optimizer,
        last backward), and the stage's gradient sync time: its exposed extra is optimizer + max(0, sync -
        last backward).

        `sync_bw`: one gradient-sync bandwidth for every layer, or one per sync group as `link_vector` gives
        them: (embedding, layer 0, ..., layer L-1, LM head), or such a vector per stage (the links each
        stage's node would give the groups, the other replicas held fixed)."""
        p, slot, shape = len(self.slots), self.slots[i], self._shape(i, nl)
        k = cost.inflight(i, p, m, self.schedule)
        links = stage_links(sync_bw, i)
        key = (a if isinstance(links, tuple) else -1, nl, slot.tp, shape.first, shape.last, num_replicas, links)
        sync = self._syncs.get(key)
        if sync is None:
            if isinstance(links, tuple):
                sync = sum(cost.sync_s(self.model.layer_params / slot.tp, self.train, num_replicas, links[1 + j])
                           for j in range(a, a + nl))
                sync += shape.first * cost.sync_s(cost.embed_params_dev(self.model, slot.tp), self.train, num_replicas,
                                                  links[0])
                sync += shape.last * cost.sync_s(cost.head_params_dev(self.model, slot.tp), self.train, num_replicas,
                                                 links[-1])
            else:
                sync = cost.sync_s(shape.params_per_device(self.model, slot.tp), self.train, num_replicas, links)
            self._syncs[key] = sync
        # What does not depend on the sync, shared by every pipeline of the search with this hardware and these
        # links at a stage position of this kind.
        okey = ("options", self._hw[i], nl, shape.first, shape.last, k, self.p2p[i], b, last_b, m)
        base = self._stage_cache.get(okey)
        if base is None:
            base = []
            for kn, t in self._candidates(i, nl, b, k):
                if last_b == b:
                    tl = t
                else:  # the last micro-batch's times depend on its size, not on b or m: shared across them
                    tkey = ("last", self._hw[i], nl, shape.first, shape.last, k, self.p2p[i], last_b, kn)
                    got = self._stage_cache.get(tkey)
                    if got is None:
                        got = self._stage_cache[tkey] = cost.stage_times(slot, self.model, self.train, shape, last_b,
                                                                         k, kn, *self.p2p[i])
                    tl = got
                full, last = t.fwd_s + t.bwd_s, tl.fwd_s + tl.bwd_s
                busy = (m - 1) * full + last
                fwd = (m - 1) * t.fwd_s + tl.fwd_s
                base.append((StageChoice(nl, kn, t), full, last,
                             cost.optimizer_s(slot, self.model, self.train, shape, kn, busy, fwd), tl.bwd_s))
            self._stage_cache[okey] = base
        return base, sync

    def _exact_finish(self, n: int, b: int, num_replicas: int, sync_bw: SyncBw) -> Finish | None:
        """Exact optimum of the closed form over splits and per-stage policies (Pareto DP).

        The 1F1B closed form sum(t) + (m-2) max(t) + max(t_last) + max(extra) is not
        a min-max, so each (stage, layers covered) keeps the Pareto front of
        (sum t, max t, max t_last, max extra, sum t_last). Used for small problems.
        """
        p, num_layers = len(self.slots), self.model.num_layers
        e = int(self.edges)  # the first and the last stage may hold no layer (the embedding or the head alone)
        if p > num_layers + 2 * e:
            return None
        m = math.ceil(n / b)
        last_b = n - (m - 1) * b
        fronts: dict[int, list] = {0: [((0.0, 0.0, 0.0, 0.0, 0.0), None)]}
        prof = self.profile
        for i in range(p):
            new: dict[int, list] = {}
            ends = [num_layers] if i == p - 1 else range(max(0, i + 1 - e) if i == 0 else max(1, i + 1 - e),
                                                         min(num_layers + 1, num_layers - (p - 1 - i) + 1 + e))
            for j in ends:
                items = []
                for a, front in fronts.items():
                    if a > j or (a == j and not (e and i in (0, p - 1))):
                        continue
                    if prof is not None and any(prof[x] != self.slots[i].tp for x in range(a, j)):
                        continue
                    opts, sync = self._stage_options(i, a, j - a, b, last_b, m, num_replicas, sync_bw)
                    for (s0, s1, s2, s3, s4), ref in front:  # the hot loop: max() unrolled
                        for ch, full, last, opt, bwd in opts:
                            extra = opt + (sync - bwd) if sync > bwd else opt
                            items.append(((s0 + full, full if full > s1 else s1, last if last > s2 else s2,
                                           extra if extra > s3 else s3, s4 + last), (ref, ch)))
                if items:
                    new[j] = _pareto(items) if len(items) > 1 else items
            fronts = new
        if num_layers not in fronts:
            return None

        vec, ref = min(fronts[num_layers], key=lambda item: _closed_form(item[0], m))
        chain = []
        while ref is not None:
            ref, ch = ref
            chain.append(ch)
        return Finish(_closed_form(vec, m), b, m, tuple(reversed(chain)))

    def time_at(self, f: Finish, n: int, num_replicas: int, sync_bw: tuple[float, ...]) -> float:
        """The closed-form time of `f`'s split and policies (found by `_exact_finish` for n samples) when the
        sync groups run at `sync_bw`, the split held fixed: what `evaluate` charges that plan once the other
        replicas' splits decide each group's link."""
        b, m = f.micro_batch_size, f.num_micro_batches
        last_b = n - (m - 1) * b
        s0 = s1 = s2 = s3 = s4 = 0.0
        a = 0
        for i, ch in enumerate(f.stages):
            opts, sync = self._stage_options(i, a, ch.num_layers, b, last_b, m, num_replicas, sync_bw)
            full, last, opt, bwd = next((fu, la, op, bw) for c, fu, la, op, bw in opts if c is ch)
            s0, s1, s2, s4 = s0 + full, max(s1, full), max(s2, last), s4 + last
            s3 = max(s3, opt + max(0.0, sync - bwd))
            a += ch.num_layers
        return _closed_form((s0, s1, s2, s3, s4), m)

    def _last_times(self, i: int, ch: StageChoice, b: int, m: int) -> cost.StageTimes:
        key = (i, id(ch), b)
        if key not in self._times:
            k = cost.inflight(i, len(self.slots), m, self.schedule)
            self._times[key] = cost.stage_times(self.slots[i], self.model, self.train, self._shape(i, ch.num_layers),
                                                b, k, ch.policy, *self.p2p[i])
        return self._times[key]

    def _stage_consts(self, stages: tuple[StageChoice, ...]) -> list[tuple]:
        """Per stage, what `_time` needs that does not depend on n: (optimizer offloaded?, resident optimizer
        time or (d2h, h2d, cpu, tail), gradient bytes to sync). cost.optimizer_s and cost.sync_s, unrolled
        for the search's hot loop (tests/test_cost_model.py checks they agree)."""
        got = self._consts.get(id(stages))
        if got is None:
            out = []
            for i, ch in enumerate(stages):
                slot, kn = self.slots[i], ch.policy
                p = self._shape(i, ch.num_layers).params_per_device(self.model, slot.tp)
                pb = self.train.param_bytes
                opt: tuple[float, float, float] | float
                if kn.offload_optimizer:
                    shape = self._shape(i, ch.num_layers)
                    d2h, h2d, cpu = cost.offload_lanes(slot, self.train, kn.offload_params, p)
                    share = cost.first_layer_share(self.model, shape, slot.tp, p)
                    opt = (d2h, max(h2d, cpu), (d2h + cpu + h2d) * share)
                else:
                    opt = p * 2 * (2 * pb + self.train.optimizer_bytes_per_param) / slot.mem_bw
                out.append((kn.offload_optimizer, opt, p * self.train.grad_bytes))
            got = self._consts[id(stages)] = out  # stages live in self._splits as long as this model
        return got

    def _time(self, stages: tuple[StageChoice, ...], n: int, b: int, m: int, num_replicas: int,
              sync_bw: float) -> float:
        """The step of n samples in micro-batches of b (m of them) over these stages, with `num_replicas`
        replicas syncing gradients at `sync_bw`. What does not depend on the replicas is worked out once per
        (stages, n, b, m): a search asks again for every replica count its pipeline sets try."""
        key = (id(stages), n, b, m)  # stages live in self._splits / self._again as long as this model
        got = self._parts.get(key)
        if got is None:
            got = self._parts[key] = self._pipe_parts(stages, n, b, m)
        t_pipe, rows = got
        per_byte = 0.0 if num_replicas <= 1 else 2.0 * (num_replicas - 1) / num_replicas / sync_bw
        extra = 0.0
        for sync_bytes, bwd, opt in rows:
            extra = max(extra, max(0.0, sync_bytes * per_byte - bwd) + opt)
        return t_pipe + extra

    def _pipe_parts(self, stages: tuple[StageChoice, ...], n: int, b: int, m: int,
                    ) -> tuple[float, list[tuple[float, float, float]]]:
        """1F1B's closed form for these stages, and per stage (gradient bytes to sync, its last backward, its
        exposed optimizer time)."""
        last_b = n - (m - 1) * b
        last_t = [ch.times if last_b == b else self._last_times(i, ch, last_b, m) for i, ch in enumerate(stages)]
        full = [ch.times.fwd_s + ch.times.bwd_s for ch in stages]
        last = [t.fwd_s + t.bwd_s for t in last_t]
        t_pipe = cost.closed_form_1f1b(sum(full), max(full), max(last), sum(last), m)
        rows = []
        for (offloaded, opt, sync_bytes), ch, lt, f, la in zip(self._stage_consts(stages), stages, last_t, full, last,
                                                              strict=True):
            if offloaded:
                busy = (m - 1) * f + la
                fwd = (m - 1) * ch.times.fwd_s + lt.fwd_s
                d2h, h2d_cpu, tail = opt
                opt = max(0.0, d2h - (busy - fwd), h2d_cpu - fwd) + tail
            rows.append((sync_bytes, lt.bwd_s, opt))
        return t_pipe, rows

EDGE_RATIO = 0.5


def _band_step(prim: np.ndarray, sec: np.ndarray, pad: int, i: int, w: int, val: np.ndarray, t: np.ndarray,
               most: int, last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One step of the layer-split DP: stage i (the i-th of the range) ending at layer i+1+j for j in 0..w-1,
    from a start i+a (a in 0..w-1) after the stages before it, taking j+1-a layers, at most `most` (past it,
    or past where nothing fits, `val` is inf). `prim` (best max stage cost) and `sec` (its sum of times) hold
    layer c at index pad + c, after `pad` >= most - 1 columns of inf (prim) and 0 (sec) that a window reaching
    before layer 0 reads. Returns the arrays after the stage, in the same layout: per end the best prim, and
    the least sec among the starts that tie on it within 1e-12 (the earliest start among equals); and per end
    its start a. Only the `most` starts within reach of each end are looked at: a (w, most) window, not the
    (w, w) band of every start and end, which for a stage of a few layers in a deep model is mostly out of
    reach. An end no start reaches gets prim inf (its sec and start are read by no split). `last`: the stage
    must end at the last layer (only j = w-1 counts)."""
    most = max(most, 1)
    at = (pad + i + 1 - most) * 8
    # Row j, column r: the start a = j + 1 - most + r, so the stage takes most - r layers (r ascending is a
    # ascending, as the earliest-start tie rule reads them). Strided views of the rows: numpy's
    # sliding_window_view builds the same view at 30x the cost.
    rows, base = _band_rows(w, most)
    new_p, new_s = _filled(len(prim), np.inf), np.zeros(len(sec))
    if last:  # only the end at the last layer counts
        cand_p = np.maximum(prim[pad + i + w - most:pad + i + w], val[most:0:-1])
        cand_s = sec[pad + i + w - most:pad + i + w] + t[most:0:-1]
        best = cand_p.min()
        r = int(np.where(cand_p <= best * (1 + 1e-12), cand_s, np.inf).argmin())
        new_p[pad + i + w], new_s[pad + i + w] = best, cand_s[r]
        start = np.zeros(w, dtype=np.int64)  # the ends before the last are reached by no split
        start[w - 1] = base[w - 1] + r
        return new_p, new_s, start
    cand_p = np.maximum(np.ndarray((w, most), np.float64, prim, at, (8, 8)), val[most:0:-1])
    cand_s = np.ndarray((w, most), np.float64, sec, at, (8, 8)) + t[most:0:-1]
    best_p = cand_p.min(axis=1)
    r = np.where(cand_p <= best_p[:, None] * (1 + 1e-12), cand_s, np.inf).argmin(axis=1)
    new_p[pad + i + 1:pad + i + 1 + w] = best_p
    new_s[pad + i + 1:pad + i + 1 + w] = cand_s[rows, r]
    return new_p, new_s, base + r  # (a start before the range's first only where no start reaches: never read)


@functools.cache
def _band_rows(w: int, most: int) -> tuple[np.ndarray, np.ndarray]:
    """`_band_step`'s row numbers 0..w-1, and each row's first start (j + 1 - most)."""
    rows = np.arange(w)
    return rows, rows + 1 - most


_FILLED: dict[tuple[int, float], np.ndarray] = {}


def _filled(n: int, value: float) -> np.ndarray:
    """A new array of n copies of `value` (a copy of a kept one: np.full's Python wrapper costs more, and the DP
    asks for millions)."""
    got = _FILLED.get((n, value))
    if got is None:
        got = _FILLED[(n, value)] = np.full(n, value)
    return got.copy()


def edge_ranges(num_stages: int, edges: bool) -> list[tuple[int, int]]:
    """Which stages [lo, hi) of a pipeline hold the transformer layers: all of them, or (with `edges`, on two
    stages or more) all but an embedding-only first stage, a head-only last stage, or both."""
    p = num_stages
    if not edges or p < 2:
        return [(0, p)]
    return [(0, p), (1, p), (0, p - 1)] + ([(1, p - 1)] if p >= 3 else [])


def edge_stages_may_win(model: ModelSpec) -> bool:
    """Whether an embedding-only or head-only stage is worth searching: the LM head (tied or not, its
    parameters and its vocab-wide GEMM) weighs at least EDGE_RATIO of a transformer layer."""
    return model.head_params >= EDGE_RATIO * model.layer_params


def _closed_form(v: tuple[float, float, float, float, float], m: int) -> float:
    """1F1B's closed form (cost.closed_form_1f1b) from (sum t, max t, max t_last, max extra, sum t_last) over a
    pipeline's stages, plus the slowest stage's extra."""
    return cost.closed_form_1f1b(v[0], v[1], v[2], v[4], m) + v[3]


@functools.cache
def _shape(n: int, first: bool, last: bool) -> cost.StageShape:
    return cost.StageShape(n, first, last)  # frozen dataclasses are slow to build; the search asks millions of times


def _pareto(items: list) -> list:
    items.sort(key=lambda it: it[0])
    kept: list = []
    for v, ref in items:  # sorted, so a vector that dominates comes first; five fields, unrolled (hot loop)
        v0, v1, v2, v3, v4 = v
        for (k0, k1, k2, k3, k4), _ in kept:
            if k0 <= v0 and k1 <= v1 and k2 <= v2 and k3 <= v3 and k4 <= v4:
                break
        else:
            kept.append((v, ref))
    return kept


def allocate_samples(pipes: list[PipelineModel], global_batch: int, exact: bool,
                     sync_bw: SyncBw) -> list[int] | None:
    """Split the global batch over pipelines minimizing the slowest finish (min-max).

    Exact DP over (pipeline, samples so far) for small problems; otherwise greedy,
    one sample at a time to the pipeline that finishes earliest after taking it.
    """
    k = len(pipes)
    if global_batch < k:
        return None

    def fin(r: int, n: int) -> float:
        f = pipes[r].finish(n, k, sync_bw)
        return math.inf if f is None else f.time_s

    if exact:
        return _allocate_exact(fin, k, global_batch)
    if any(fin(r, 1) == math.inf for r in range(k)):
        return None
    # Seed in proportion to each pipeline's rate at an equal share, then top up greedily.
    share = max(1, global_batch // k)
    rates = []
    for r in range(k):
        n = share
        while fin(r, n) == math.inf:  # the largest share this pipeline can take
            n //= 2
        rates.append(n / fin(r, n))
    total = sum(rates)
    counts = [max(1, int(global_batch * x / total)) for x in rates]
    while sum(counts) > global_batch:
        r = max((i for i in range(k) if counts[i] > 1), key=lambda i: (fin(i, counts[i]), i))
        counts[r] -= 1
    heap = [(fin(r, counts[r] + 1), r) for r in range(k)]
    heapq.heapify(heap)
    for _ in range(global_batch - sum(counts)):
        t, r = heapq.heappop(heap)
        if t == math.inf:
            return None
        counts[r] += 1
        heapq.heappush(heap, (fin(r, counts[r] + 1), r))
    return _rebalance(fin, counts)


def _rebalance(fin: Callable[[int, int], float], counts: list[int]) -> list[int]:
    """Move single samples off the slowest pipeline while that lowers the slowest finish."""
    k = len(counts)
    cur = [fin(i, counts[i]) for i in range(k)]
    nxt = [fin(i, counts[i] + 1) for i in range(k)]
    # Heaps with lazy deletion: the slowest (largest cur, lowest index first) and the fastest to take one more
    # (smallest nxt, lowest index first); O(k log k) where a scan per move was O(k^2) on a thousand GPUs.
    slow_h = [(-cur[i], i) for i in range(k)]
    fast_h = [(nxt[i], i) for i in range(k)]
    heapq.heapify(slow_h)
    heapq.heapify(fast_h)
    for _ in range(4 * k):
        while -slow_h[0][0] != cur[slow_h[0][1]]:
            heapq.heappop(slow_h)
        while fast_h[0][0] != nxt[fast_h[0][1]]:
            heapq.heappop(fast_h)
        slow, fast = slow_h[0][1], fast_h[0][1]
        if counts[slow] == 1 or fast == slow or nxt[fast] >= cur[slow]:
            break
        counts[slow] -= 1
        counts[fast] += 1
        for i in (slow, fast):
            cur[i], nxt[i] = fin(i, counts[i]), fin(i, counts[i] + 1)
            heapq.heappush(slow_h, (-cur[i], i))
            heapq.heappush(fast_h, (nxt[i], i))
    return counts


def _allocate_exact(fin: Callable[[int, int], float], k: int, global_batch: int) -> list[int] | None:
    dp: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for r in range(k):
        left_after = k - r - 1
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for s, (mx, alloc) in dp.items():
            for n in range(1, global_batch - s - left_after + 1):
                t = fin(r, n)
                if t == math.inf:
                    continue
                val = max(mx, t)
                if s + n not in nxt or val < nxt[s + n][0]:
                    nxt[s + n] = (val, alloc + (n,))
        dp = nxt
    got = dp.get(global_batch)
    return list(got[1]) if got else None
