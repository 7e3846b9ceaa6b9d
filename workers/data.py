"""Datasets indexed by global sample index: deterministic and independent of the plan.

Step s consumes samples [s*B, (s+1)*B); a sample is seq_len + 1 tokens (inputs and
shifted targets). Because a sample depends only on its index, resuming at any
step under any plan sees the same data: none lost, none repeated.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from workers.corpus_index import open_local
from workers.data_validation import DataError, TokenArray, check_data, check_window, min_tokens, shard_paths
from workers.epochs import EpochOrder
from workers.s3_data import CacheConfig, S3Array, is_s3


class Dataset(Protocol):
    vocab_size: int

    def batch(self, indices: range) -> torch.Tensor:
        """LongTensor [len(indices), seq_len + 1]."""
        ...


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])


class SyntheticCorpus:
    """Learnable sequences: arithmetic progressions mod vocab with a per-sample stride.

    A model that reads the first tokens can infer the stride and predict the rest,
    so the loss falls visibly within a few hundred steps on CPU.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, num_strides: int = 7):
        self.vocab_size, self.seq_len, self.seed, self.num_strides = vocab_size, seq_len, seed, num_strides

    def batch(self, indices: range) -> torch.Tensor:
        rows = []
        steps = np.arange(self.seq_len + 1)
        for i in indices:
            r = _rng(self.seed, i)
            start, stride = r.integers(self.vocab_size), 1 + r.integers(self.num_strides)
            rows.append((start + stride * steps) % self.vocab_size)
        return torch.from_numpy(np.stack(rows)).long()


class _Windowed:
    """Non-overlapping windows of `seq_len + 1` tokens of one token array or several shards, read in epochs that
    are permutations (workers/epochs.py): an epoch reads every window once. Every window is checked against the
    vocabulary as it is read (workers/data_validation.py)."""

    def __init__(self, shards: TokenArray | list[TokenArray], vocab_size: int, seq_len: int, seed: int,
                 source: str, holdout: float = 0.0):
        self.shards = shards if isinstance(shards, list) else [shards]
        total = sum(len(t) for t in self.shards)
        if total < min_tokens(seq_len) or not any(len(t) >= seq_len + 1 for t in self.shards):
            raise DataError(f"{source} has {total} tokens (its longest shard {max(len(t) for t in self.shards)}); "
                            f"need at least seq_len + 2 = {min_tokens(seq_len)} in one shard")
        self.vocab_size, self.seq_len, self.seed, self.source = vocab_size, seq_len, seed, source
        lengths = [len(t) for t in self.shards]
        windows = sum(n // (seq_len + 1) for n in lengths)
        # holdout: a fraction of the windows (< 1) kept out of training, or 1.0: all of them (a validation file)
        held = windows if holdout >= 1.0 else int(windows * holdout)
        if holdout and not held:
            raise DataError(f"data.val_fraction {holdout} of {source}'s {windows} windows of seq_len + 1 = "
                            f"{seq_len + 1} tokens is no whole window; raise it to at least {1 / windows:.2g}")
        if held == windows and holdout < 1.0:
            raise DataError(f"data.val_fraction {holdout} leaves no window of {source} to train on; lower it")
        self.order = EpochOrder(lengths, seq_len + 1, seed, held)

    @property
    def tokens(self) -> TokenArray:  # one file's tokens (what a one-shard corpus is)
        return self.shards[0]

    def batch(self, indices: range, pool: ThreadPoolExecutor | None = None) -> torch.Tensor:
        """The samples' windows; with `pool`, read side by side (on S3 without a cache, one ranged GET each: S3
        serves one range a request and the windows lie anywhere in the corpus; with the node's block cache,
        windows in one block share its GET)."""
        where = [self.order.locate(i) for i in indices]
        rows = list(pool.map(self._window, where)) if pool is not None else [self._window(w) for w in where]
        return torch.from_numpy(np.stack(rows))

    def held_out(self) -> HeldOut:
        """The held-out windows as a dataset: sample i is the i-th of them."""
        return HeldOut(self)

    def _window(self, where: tuple[int, int]) -> np.ndarray:
        shard, o = where
        row = np.asarray(self.shards[shard][o:o + self.seq_len + 1], dtype=np.int64)
        check_window(row, self.vocab_size, self.source if len(self.shards) == 1 else f"{self.source} (shard {shard})",
                     o)
        return row


class HeldOut:
    """A corpus's held-out windows (a validation set), sample i the i-th, in corpus order."""

    def __init__(self, inner: _Windowed):
        self.inner, self.vocab_size, self.samples = inner, inner.vocab_size, inner.order.held

    def batch(self, indices: range) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.inner._window(self.inner.order.locate_held(i)) for i in indices]))


class ReadAhead:
    """A remote dataset (S3) read ahead of the step: `prefetch(ranges)` starts reading micro-batches on a thread
    (their windows side by side on a pool of `window_threads`), `batch(r)` hands one over once it is in, so the
    step's forward never waits on S3's first-byte latency when it was asked for early enough. Batches are kept
    in a bounded LRU (`keep`): a redone step after a recovery reads them again from memory. The data stays a
    function of the sample index: the same batches, wherever and whenever they are read."""

    def __init__(self, inner: _Windowed, window_threads: int = 16, keep: int = 64):
        self.inner, self.vocab_size, self.keep = inner, inner.vocab_size, keep
        self._windows = ThreadPoolExecutor(window_threads, thread_name_prefix="hetspot-data")
        self._batches = ThreadPoolExecutor(2, thread_name_prefix="hetspot-readahead")
        self._got: OrderedDict[tuple[int, int], Future] = OrderedDict()
        self._lock = threading.Lock()

    def prefetch(self, ranges: list[range]) -> None:
        for r in ranges:
            self._future(r)

    def _future(self, r: range) -> Future:
        key = (r.start, r.stop)
        with self._lock:
            fut = self._got.get(key)
            if fut is None:
                fut = self._got[key] = self._batches.submit(self.inner.batch, r, self._windows)
                while len(self._got) > self.keep:
                    self._got.popitem(last=False)
            else:
                self._got.move_to_end(key)
            return fut

    def batch(self, indices: range) -> torch.Tensor:
        return self._future(indices).result()


class TextFile(_Windowed):
    """Byte-level text: token ids are the bytes, so the model's vocabulary must cover them (256 for any text).
    A local file is read whole; an s3:// one window by window (workers/s3_data.py). A folder (or an s3:// prefix
    ending in "/") is a corpus of shards, in name order."""

    def __init__(self, path: str, seq_len: int, seed: int = 0, vocab_size: int = 256, endpoint_url: str | None = None,
                 cache: CacheConfig | None = None, holdout: float = 0.0, index: list[dict] | None = None):
        def one(p: str, entry: dict | None) -> TokenArray:
            if is_s3(p):
                return S3Array(p, "uint8", endpoint_url, cache=cache, expect=entry, source=f"data.path {path!r}")
            if entry is not None:
                return np.array(open_local(entry, f"data.path {path!r}"))  # read whole, as below
            return np.frombuffer(Path(p).read_bytes(), dtype=np.uint8)
        super().__init__([one(p, e) for p, e in _shards(path, endpoint_url, index)], vocab_size, seq_len, seed, path,
                         holdout)


class TokenFile(_Windowed):
    """A flat token file (nanoGPT's .bin): uint16 or uint32, memory-mapped, or in S3 read by ranged GETs; a folder
    (or an s3:// prefix ending in "/") of such files is a corpus of shards, in name order."""

    def __init__(self, path: str, seq_len: int, vocab_size: int, dtype: str = "uint16", seed: int = 0,
                 endpoint_url: str | None = None, cache: CacheConfig | None = None, holdout: float = 0.0,
                 index: list[dict] | None = None):
        def one(p: str, entry: dict | None) -> TokenArray:
            if is_s3(p):
                return S3Array(p, dtype, endpoint_url, cache=cache, expect=entry, source=f"data.path {path!r}")
            if entry is not None:
                raw = open_local(entry, f"data.path {path!r}")
                return raw[:len(raw) // np.dtype(dtype).itemsize * np.dtype(dtype).itemsize].view(np.dtype(dtype))
            return np.memmap(p, dtype=np.dtype(dtype), mode="r")
        super().__init__([one(p, e) for p, e in _shards(path, endpoint_url, index)], vocab_size, seq_len, seed, path,
                         holdout)


def _shards(path: str, endpoint_url: str | None, index: list[dict] | None) -> list[tuple[str, dict | None]]:
    """The shards to open, each with its entry in the job's corpus index: exactly the indexed ones when the job
    carries an index (workers/corpus_index.py), else what the path names now."""
    if index is not None:
        return [(e["path"], e) for e in index]
    return [(p, None) for p in shard_paths(path, endpoint_url)]


def make_dataset(kind: str, seq_len: int, vocab_size: int, seed: int = 0, path: str | None = None,
                 dtype: str = "uint16", endpoint_url: str | None = None, cache: CacheConfig | None = None,
                 holdout: float = 0.0, index: list[dict] | None = None) -> Dataset:
    """`cache`: the node's block cache for S3 data (CacheConfig.from_data(job's data section)); None reads each
    window with its own GET. `holdout`: the fraction of the corpus's windows kept out of training (the last
    ones: `held_out(dataset)` reads them). `index`: the shards as the job indexed them at submit
    (workers/corpus_index.py): exactly these are opened, each checked against its size and version."""
    if kind == "synthetic":
        return SyntheticCorpus(vocab_size, seq_len, seed)
    if path is None:
        raise DataError(f"data.kind {kind!r} reads a file: set data.path to it (a local path or s3://bucket/key)")
    if kind == "text":
        if not is_s3(path):  # a local file is read whole here anyway; S3 windows are checked as they are read
            if index is None:
                check_data(kind, path, seq_len, vocab_size)  # bytes past the vocabulary: a clear DataError
            return TextFile(path, seq_len, seed, vocab_size, endpoint_url, holdout=holdout, index=index)
        return ReadAhead(TextFile(path, seq_len, seed, vocab_size, endpoint_url, cache, holdout, index))
    if kind == "tokens":
        tokens = TokenFile(path, seq_len, vocab_size, dtype, seed, endpoint_url, cache, holdout, index)
        return ReadAhead(tokens) if is_s3(path) else tokens
    raise ValueError(f"unknown data kind {kind!r}; use synthetic, text or tokens")


SYNTHETIC_HELD_OUT = 1_000_003  # the synthetic corpus's validation samples: another seed's


def make_datasets(data: dict, seq_len: int, vocab_size: int, seed: int = 0, cache: CacheConfig | None = None,
                  validation: bool = False) -> tuple[Dataset, Dataset | None]:
    """A job's training set and, with `validation`, its held-out set: `data.val_path` (a corpus of its own, its
    windows in order), else `data.val_fraction` of the corpus's windows carved off its end (never trained on:
    the training set leaves them out whether or not this call asks for them), else, for synthetic data, another
    seed's samples. `data` is the job's data section as the workers receive it, with its corpus index."""
    kind, path, dtype, endpoint = (data.get("kind", "synthetic"), data.get("path"), data.get("dtype", "uint16"),
                                   data.get("endpoint_url"))
    val_path, fraction = data.get("val_path"), float(data.get("val_fraction") or 0.0)
    index = data.get("index") or {}
    train = make_dataset(kind, seq_len, vocab_size, seed, path, dtype, endpoint, cache,
                         0.0 if val_path else fraction, index.get("shards"))
    if not validation:
        return train, None
    if val_path:
        inner = _windowed(make_dataset(kind, seq_len, vocab_size, seed, val_path, dtype, endpoint, cache, 1.0,
                                       index.get("val_shards")))
        return train, inner.held_out()
    if kind == "synthetic":
        return train, SyntheticCorpus(vocab_size, seq_len, seed + SYNTHETIC_HELD_OUT)
    if not fraction:
        raise DataError("train.eval_every needs held-out data: set data.val_fraction (a share of the corpus kept "
                        "out of training) or data.val_path")
    return train, _windowed(train).held_out()


def _windowed(ds: Dataset) -> _Windowed:
    inner = ds.inner if isinstance(ds, ReadAhead) else ds
    assert isinstance(inner, _Windowed)  # (a file's dataset)
    return inner
