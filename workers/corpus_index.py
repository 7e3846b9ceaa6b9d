"""A corpus's index: its shards, each with its size and version, taken once when a job is submitted.

`index_corpus(data.path)` lists the shards a `data.path` names (one file, a local folder, or an s3:// prefix: one
listing, no request per shard) with their sizes in bytes and a version: S3's ETag, or for a local file a SHA-256
of its size and its first and last 4 KiB (`local_version`: a copy on another node has the same one, a file written
again by another tokenizer or cut another way has not, and checking it reads 8 KiB). The submit path writes the
index into the job (`data.index`), so it travels with the job to the controller, into the run record and to every
worker; a worker opens exactly the indexed shards (a file added to the folder later is not read: it would change
the windows and so every sample) and refuses one whose size or version differs, in one line naming it. A sample is
a window picked by its global index (workers/epochs.py): a corpus that changed under a job would make the same
index read other tokens, and a resume would neither lose nor repeat samples only by accident.

`data_digest` condenses what decides the samples (the shards, their versions, the held-out share) into the string
every checkpoint manifest records, so a resume onto a changed corpus is refused as well.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from workers.data_errors import DataError
from workers.shard_check import check_shard

ENDS = 4096  # bytes of each end of a local shard that its version hashes


def local_version(path: str | Path, size: int) -> str:
    """A local shard's version: SHA-256 of its size and its first and last `ENDS` bytes."""
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(ENDS))
        if size > ENDS:
            f.seek(max(ENDS, size - ENDS))
            h.update(f.read(ENDS))
    return "ends-sha256:" + h.hexdigest()[:32]


def index_corpus(path: str, endpoint_url: str | None = None, field: str = "data.path") -> list[dict]:
    """`[{"path", "bytes", "version"}]` for the shards `path` names, in name order (DataError naming `field` where
    there are none or one cannot be read)."""
    from workers.data_validation import shard_paths
    from workers.s3_data import S3Array, is_s3, prefix_objects

    if is_s3(path):
        if path.endswith("/"):
            found = prefix_objects(path, endpoint_url)
            if not found:
                raise DataError(f"{field} {path!r} is a prefix with no objects under it; put the corpus's token "
                                "files there (one flat array each), or point it at one object")
        else:
            one = S3Array(path, "uint8", endpoint_url)
            found = {path: (one.size_bytes, one.etag)}
        return [{"path": p, "bytes": n, "version": etag} for p, (n, etag) in found.items()]
    out = []
    for shard in shard_paths(path):
        p = Path(shard).expanduser()
        try:
            size = p.stat().st_size
            out.append({"path": shard, "bytes": size, "version": local_version(p, size)})
        except OSError as e:
            raise DataError(f"{field} {path!r}: shard {shard!r} cannot be read ({e.strerror}); check the path and "
                            "its permissions") from None
    return out


def open_local(entry: dict, source: str):
    """A local shard checked against its index entry, then memory-mapped as raw bytes (the caller views it)."""
    import numpy as np

    p = Path(entry["path"]).expanduser()
    try:
        size = p.stat().st_size
        version = local_version(p, size) if entry["version"] else ""
    except OSError as e:
        raise DataError(f"{source}: shard {entry['path']!r} cannot be read on this node ({e.strerror}); a local "
                        "data.path must hold the same files on every node (or use s3://)") from None
    check_shard(entry, size, version, source)
    return np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)


def windows_of(entries: list[dict], itemsize: int, window: int) -> int:
    """The windows of `window` tokens the indexed shards hold (workers/epochs.py: none crosses a shard's end)."""
    return sum((e["bytes"] // itemsize) // window for e in entries)


def training_windows(data: dict, seq_len: int) -> int | None:
    """The samples of one epoch (the indexed corpus's windows less the held-out ones) from a job's data section;
    None for synthetic data or a job not indexed."""
    index = data.get("index")
    if data.get("kind", "synthetic") == "synthetic" or not index:
        return None
    itemsize = 1 if data.get("kind") == "text" else {"uint16": 2, "uint32": 4}[data.get("dtype", "uint16")]
    windows = windows_of(index["shards"], itemsize, seq_len + 1)
    return windows - (0 if data.get("val_path") else int(windows * float(data.get("val_fraction") or 0.0)))


def data_digest(data: dict) -> str:
    """What decides a job's samples, condensed: the data's kind and dtype, its indexed shards (path, size, version)
    and the held-out share carved from them. Synthetic data: its kind alone."""
    if data.get("kind", "synthetic") == "synthetic":
        return "synthetic"
    index = data.get("index") or {}
    what = {"kind": data.get("kind"), "dtype": data.get("dtype", "uint16"), "shards": index.get("shards"),
            "val_fraction": 0.0 if data.get("val_path") else float(data.get("val_fraction") or 0.0)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]

