"""Checks of a job's training data, run before any cluster starts (numpy only: no torch, no Ray).

`check_data` raises `DataError` with one message that names `data.path`, what is
wrong and the fix. Token ids are checked on a sample of the file (every token
of a file up to `FULL_SCAN_TOKENS`, else evenly spaced windows), and the
datasets in workers/data.py check every window they read, so an id past the
vocabulary can never reach the embedding as an opaque IndexError.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from workers.data_errors import DataError  # noqa: F401  (raised here; callers import it from this module)


class TokenArray(Protocol):
    """A flat token array as the datasets read it: a numpy array or memory map, or an S3 object read by ranged
    GETs (workers/s3_data.py `S3Array`)."""

    def __len__(self) -> int: ...

    def __getitem__(self, sl: slice) -> Any: ...

FULL_SCAN_TOKENS = 1 << 24  # 16M tokens: read whole; larger files are sampled
SAMPLE_WINDOWS, WINDOW_TOKENS = 256, 4096
ITEMSIZE = {"uint16": 2, "uint32": 4}


def min_tokens(seq_len: int) -> int:
    """Tokens a file needs: one sample of seq_len + 1 tokens at more than one offset."""
    return seq_len + 2


def shard_paths(path: str, endpoint_url: str | None = None) -> list[str]:
    """The files a `data.path` names: itself, or for a local folder (or an s3:// prefix ending in "/") the files
    in it (not its sub-folders; hidden files left out), in name order: a corpus of shards."""
    if path.startswith("s3://"):
        if not path.endswith("/"):
            return [path]
        from workers.s3_data import list_prefix

        found = list_prefix(path, endpoint_url)
    else:
        p = Path(path)
        if not p.is_dir():
            return [path]
        found = [str(f) for f in sorted(p.iterdir()) if f.is_file() and not f.name.startswith(".")]
    if not found:
        raise DataError(f"data.path {path!r} is a folder with no files in it; put the corpus's token files there "
                        "(one flat array each), or point data.path at one file")
    return found


def corpus_windows(kind: str, path: str | None, seq_len: int, dtype: str = "uint16",
                   endpoint_url: str | None = None) -> int | None:
    """How many samples an epoch of the corpus is (its windows: workers/epochs.py); None for synthetic data."""
    if kind == "synthetic" or not path:
        return None
    itemsize = 1 if kind == "text" else ITEMSIZE[dtype]
    if path.startswith("s3://"):
        from workers.s3_data import S3Array, prefix_sizes

        # a prefix's sizes from its one listing (no request per shard); one object's from its HEAD
        sizes = (list(prefix_sizes(path, endpoint_url).values()) if path.endswith("/")
                 else [S3Array(path, "uint8", endpoint_url).size_bytes])
    else:
        sizes = [Path(shard).expanduser().stat().st_size for shard in shard_paths(path)]
    if not sizes:
        raise DataError(f"data.path {path!r} is a folder with no files in it")
    return sum((n // itemsize) // (seq_len + 1) for n in sizes)


def check_data(kind: str, path: str | None, seq_len: int, vocab_size: int, dtype: str = "uint16",
               endpoint_url: str | None = None) -> None:
    """`path` is a local file or s3://BUCKET/KEY (read by ranged GETs: its size, then the sampled windows), or a
    folder or s3:// prefix of shards (each checked so, and at least one holding a whole sample)."""
    if kind == "synthetic":
        return
    if path is not None:
        shards = shard_paths(path, endpoint_url)
        if shards != [path]:
            longest = 0
            for shard in shards:
                try:
                    longest = max(longest, _check_one(kind, shard, 0, vocab_size, dtype, endpoint_url))
                except DataError as e:
                    raise DataError(f"data.path {path!r}: shard {shard!r}: "
                                    f"{str(e).removeprefix(f'data.path {shard!r} ')}") from None
            if longest < min_tokens(seq_len):
                raise DataError(f"data.path {path!r}: no shard holds a whole sample (the longest has {longest:,} "
                                f"tokens; a sample needs seq_len + 1 = {seq_len + 1}): use longer shards or a smaller "
                                "model.seq_len")
            return
    _check_one(kind, path, seq_len, vocab_size, dtype, endpoint_url)


def _check_one(kind: str, path: str | None, seq_len: int, vocab_size: int, dtype: str,
               endpoint_url: str | None) -> int:
    """One file's checks (seq_len 0: any length); its tokens."""
    itemsize = 1 if kind == "text" else ITEMSIZE[dtype]
    if path is not None and path.startswith("s3://"):
        from workers.s3_data import S3Array

        s3 = S3Array(path, "uint8" if kind == "text" else dtype, endpoint_url)
        size = s3.size_bytes
        open_tokens: Callable[[], TokenArray] = lambda: s3  # noqa: E731
    else:
        p = _readable(path)
        size = p.stat().st_size
        item = np.uint8 if kind == "text" else np.dtype(dtype)
        open_tokens = lambda: np.memmap(p, dtype=item, mode="r")  # noqa: E731
    if size == 0:
        raise DataError(f"data.path {path!r} is empty; point it at a non-empty "
                        f"{'text' if kind == 'text' else dtype} file")
    if size % itemsize:
        raise DataError(f"data.path {path!r} has {size:,} bytes, not a multiple of {itemsize} ({dtype}); "
                        f"it is not a flat {dtype} token file: check data.dtype (uint16 or uint32) or the file")
    tokens = open_tokens()
    if seq_len and len(tokens) < min_tokens(seq_len):
        raise DataError(f"data.path {path!r} holds {len(tokens):,} tokens; a sample needs seq_len + 1 = {seq_len + 1} "
                        f"and the file at least {min_tokens(seq_len)}: use a longer file or a smaller model.seq_len")
    top, where = _max_token(tokens)
    if top >= vocab_size:
        if kind == "text":
            raise DataError(f"data.path {path!r} holds byte value {top} (at byte {where:,}) but model.vocab_size is "
                            f"{vocab_size}; text data is byte-level: set model.vocab_size >= 256")
        raise DataError(f"data.path {path!r} holds token id {top} (at token {where:,}) but model.vocab_size is "
                        f"{vocab_size}: set model.vocab_size above {top}, or check that the file was written as "
                        f"{dtype} with this model's tokenizer")
    return len(tokens)


def check_window(tokens: np.ndarray, vocab_size: int, source: str, offset: int) -> None:
    """The cheap per-read check the datasets run on every window they hand out."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        i = int(np.argmax(tokens >= vocab_size))
        raise DataError(f"{source}: token id {int(tokens[i])} at token {offset + i:,} is not below "
                        f"model.vocab_size={vocab_size}")


def _readable(path: str | None) -> Path:
    if not path:
        raise DataError("data.path is not set; give the file to read")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path {path!r} does not exist; give the path of the training file")
    if not p.is_file():
        raise DataError(f"data.path {path!r} is not a file; give the path of the training file itself")
    if not os.access(p, os.R_OK):
        raise DataError(f"data.path {path!r} is not readable; fix its permissions")
    return p


def _max_token(tokens: TokenArray) -> tuple[int, int]:
    """(largest id, its index) over the whole file if small, else over evenly spaced windows."""
    n = len(tokens)
    if n <= FULL_SCAN_TOKENS:
        whole = np.asarray(tokens[0:n])
        i = int(np.argmax(whole))
        return int(whole[i]), i
    best, where = -1, 0
    for start in np.linspace(0, n - WINDOW_TOKENS, SAMPLE_WINDOWS).astype(np.int64):
        w = np.asarray(tokens[start:start + WINDOW_TOKENS])
        i = int(np.argmax(w))
        if int(w[i]) > best:
            best, where = int(w[i]), int(start) + i
    return best, where
