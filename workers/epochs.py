"""Which window of a corpus a global sample reads: epochs as permutations.

A corpus (one token array, or several shards) is cut into non-overlapping windows of `seq_len + 1` tokens: shard
`s` of `n_s` tokens holds `n_s // (seq_len + 1)` of them, from its first token, and the tokens after its last whole
window (fewer than `seq_len + 1`) are not read. A window never crosses a shard's end, since documents do not go on
across files. With `W` windows in all, global sample `g` reads window `perm_e(g mod W)` of epoch `e = g div W`,
where `perm_e` is a bijection of `[0, W)` drawn from the seed and the epoch: an epoch reads every window exactly
once (Megatron-LM, nanotron, torchtitan and MosaicML streaming all define an epoch so), the next epoch in another
order, and a sample stays a function of its global index alone, so any plan, re-plan or resume reads the same
samples. A held-out set (`holdout` windows: a validation set carved from the corpus) is the corpus's last
windows, read in order and never in an epoch.

`perm_e` is a four-round Feistel network on the smallest `4**h >= W` values, walked until it lands in `[0, W)`
(cycle walking: fewer than four rounds of the network per sample on average, since `4**h < 4W`). It is computed
per sample, never materialised: O(1) memory for any corpus, a few microseconds a sample.
"""

from __future__ import annotations

import bisect

_M64 = (1 << 64) - 1
ROUNDS = 4


def _mix(x: int) -> int:
    """splitmix64's finaliser: a 64-bit integer hash (the same in every process; Python's `hash` is salted)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A seeded bijection of `[0, n)`, evaluated one index at a time."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError("a permutation of no elements")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n
        self.mask = (1 << self.half) - 1
        self.keys = [_mix(key * ROUNDS + r) for r in range(ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        x = self._feistel(i)
        while x >= self.n:  # cycle walking: the walk from an index in [0, n) returns to [0, n)
            x = self._feistel(x)
        return x


class EpochOrder:
    """Global sample index -> (shard, token offset in it) for shards of `lengths` tokens and windows of
    `window` tokens; `epoch_of(g)` and `progress(g)` for the run record."""

    def __init__(self, lengths: list[int], window: int, seed: int, holdout: int = 0):
        self.window, self.seed = window, seed
        counts = [n // window for n in lengths]
        self.starts = [0]
        for c in counts:
            self.starts.append(self.starts[-1] + c)
        if self.starts[-1] == 0:
            raise ValueError(f"no shard holds a whole window of {window} tokens")
        if not 0 <= holdout <= self.starts[-1]:
            raise ValueError(f"a held-out set of {holdout} windows from a corpus of {self.starts[-1]}")
        # The last `holdout` windows (the end of the last shards) are held out: never in an epoch.
        self.windows, self.held = self.starts[-1] - holdout, holdout
        self._perms: dict[int, Permutation] = {}

    def _perm(self, epoch: int) -> Permutation:
        p = self._perms.get(epoch)
        if p is None:
            if len(self._perms) > 4:
                self._perms.clear()
            p = self._perms[epoch] = Permutation(self.windows, _mix((self.seed << 20) ^ epoch))
        return p

    def window_of(self, g: int) -> int:
        """The window (in `[0, windows)`) global sample `g` reads."""
        epoch, i = divmod(g, self.windows)
        return self._perm(epoch)(i)

    def locate(self, g: int) -> tuple[int, int]:
        """(shard, first token) of global sample `g`'s window."""
        return self._place(self.window_of(g))

    def locate_held(self, i: int) -> tuple[int, int]:
        """(shard, first token) of held-out sample `i`: the held-out windows in corpus order."""
        if not 0 <= i < self.held:
            raise IndexError(f"held-out sample {i} of {self.held}")
        return self._place(self.windows + i)

    def _place(self, w: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, w) - 1
        return shard, (w - self.starts[shard]) * self.window

    def epoch_of(self, g: int) -> int:
        return g // self.windows

    def progress(self, samples: int) -> float:
        """Epochs done after `samples` samples (2.25: two whole epochs and a quarter of the third)."""
        return samples / self.windows
