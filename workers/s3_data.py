"""Training data in S3: a flat token (or byte) file read in place, by ranged GETs, through a node's block cache.

`data: {kind: tokens, path: s3://BUCKET/KEY}` (or `kind: text`) makes each worker
read the byte ranges of the samples its replica trains (`Range: bytes=a-b`), so
nothing is copied to the nodes first and the sample-index semantics are those of
a local file: the same index gives the same window. The client is boto3's, with
its standard credentials chain (environment, profile, instance role, IRSA) and
endpoint (`data.endpoint_url`, else AWS_ENDPOINT_URL, else AWS), and the
standard retry mode, as the checkpoints use. `S3Array` is a read-only numpy-like
view (`len`, `[a:b]`) that the windowed datasets and the up-front checks
(workers/data_validation.py) slice like a memory-mapped file.

With a `BlockCache` (a job's default: `data.cache_gb`), a window is read from
fixed blocks of the object (`data.block_mib`) kept in files on the node's local
disk, shared by every worker process there and bounded by evicting the least
recently used: windows that fall in one block cost one GET between them (the
coalescing S3 cannot do itself: it serves one range a request), a replacement
process on the node finds the blocks its predecessor read, and once a corpus
that fits the cache has been read the node makes no request at all. A block is
named by the object's ETag and fetched with `If-Match` on it, so a cache never
serves bytes of another version of the object. The cost is read amplification
on a corpus much larger than the cache: each window that misses brings its
whole block (a block of 1 MiB against a 2 KiB window is 512x the bytes; lower
`data.block_mib` there, or `data.cache_gb: 0` for one GET per window).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from workers.data_errors import DataError

_URI = re.compile(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.+)")


def is_s3(path: str | None) -> bool:
    return path is not None and path.startswith("s3://")


def list_prefix(uri: str, endpoint_url: str | None = None) -> list[str]:
    """The objects directly under an s3:// prefix ending in "/" (not in its sub-folders), in key order, as
    s3:// URIs: a corpus's shards. DataError (naming data.path) where S3 refuses the listing."""
    return list(prefix_sizes(uri, endpoint_url))


def prefix_sizes(uri: str, endpoint_url: str | None = None) -> dict[str, int]:
    """`list_prefix`'s objects with their sizes in bytes, from the one listing."""
    return {k: n for k, (n, _) in prefix_objects(uri, endpoint_url).items()}


def prefix_objects(uri: str, endpoint_url: str | None = None) -> dict[str, tuple[int, str]]:
    """`list_prefix`'s objects with their sizes in bytes and ETags, from the one listing."""
    from botocore.exceptions import BotoCoreError, ClientError

    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])/(.*/)?", uri)
    if not m:
        raise DataError(f"data.path {uri!r} must look like s3://BUCKET/PREFIX/ (a folder of shards) or "
                        "s3://BUCKET/KEY (one file)")
    bucket, prefix = m.group(1), m.group(2) or ""
    try:
        pages = new_s3_client(endpoint_url).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        sizes = {o["Key"]: (int(o["Size"]), str(o.get("ETag", ""))) for page in pages for o in page.get("Contents", [])}
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code"))
        raise DataError(f"data.path {uri!r}: listing the shards was refused ({code}); give the job's credentials "
                        "s3:ListBucket on the bucket, or check its name") from None
    except BotoCoreError as e:
        raise DataError(f"data.path {uri!r}: cannot reach S3 ({redact(e)}); check data.endpoint_url") from None
    return {f"s3://{bucket}/{k}": n for k, n in sorted(sizes.items())
            if (r := k[len(prefix):]) and "/" not in r and not r.startswith(".")}


class S3Array:
    """An S3 object as a 1-D array of `dtype`, read by ranged GETs; `bytes_read` counts what came over."""

    def __init__(self, uri: str, dtype: str, endpoint_url: str | None = None, client=None,
                 cache: CacheConfig | None = None, expect: dict | None = None, source: str | None = None):
        """`expect`: the object's entry in the job's corpus index (workers/corpus_index.py): its size and ETag are
        checked at the HEAD, and every GET asks for that ETag (If-Match), so no byte of another version is read."""
        m = _URI.fullmatch(uri)
        if not m:
            raise DataError(f"data.path {uri!r} must look like s3://BUCKET/KEY (a bucket name of 3-63 lowercase "
                            "letters, digits, dots or dashes, then the object's key)")
        self.uri, self.bucket, self.key, self.dtype = uri, m.group(1), m.group(2), np.dtype(dtype)
        self.client = client or new_s3_client(endpoint_url)  # boto3 clients are safe to share between threads
        self.size_bytes, self.etag = self._head(endpoint_url)
        self.pinned = expect is not None and bool(expect["version"])
        if expect is not None:
            from workers.shard_check import check_shard

            check_shard(expect, self.size_bytes, self.etag, source or f"data.path {uri!r}")
        self.bytes_read = 0
        self.requests = 0
        self._count = threading.Lock()
        self.blocks = BlockCache(cache, self) if cache is not None and cache.max_bytes > 0 else None

    def _head(self, endpoint_url: str | None) -> tuple[int, str]:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self.key)
            return int(head["ContentLength"]), str(head.get("ETag", ""))
        except NoCredentialsError:
            raise DataError(f"data.path {self.uri!r}: no AWS credentials were found (boto3 looks at the environment, "
                            "~/.aws profiles and the instance role); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                            "or AWS_PROFILE") from None
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code"))
            if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
                raise DataError(f"data.path {self.uri!r} does not exist at {redact(endpoint_url or 'AWS')}; check the "
                                "bucket and key (`aws s3 ls`)") from None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise DataError(f"data.path {self.uri!r}: access was refused ({code}); give the job's credentials "
                                "s3:GetObject on it (the nodes' instance profile, IRSA, or keys)") from None
            raise DataError(f"data.path {self.uri!r}: S3 answered {code}") from None
        except BotoCoreError as e:
            raise DataError(f"data.path {self.uri!r}: cannot reach S3 ({redact(e)}); check data.endpoint_url") from None

    def __len__(self) -> int:
        return self.size_bytes // self.dtype.itemsize

    def __getitem__(self, sl: slice) -> np.ndarray:
        if not isinstance(sl, slice):
            raise TypeError("an S3Array is read by slices: a[start:stop]")
        start, stop, step = sl.indices(len(self))
        if step != 1:
            raise TypeError("an S3Array is read by contiguous slices")
        if stop <= start:
            return np.empty(0, dtype=self.dtype)
        first, end = start * self.dtype.itemsize, stop * self.dtype.itemsize
        body = self.blocks.read(first, end) if self.blocks is not None else self.get_range(first, end)
        return np.frombuffer(body, dtype=self.dtype)

    def get_range(self, first: int, end: int) -> bytes:
        """Bytes [first, end) of the object in one GET (of the version the array was opened on, when cached)."""
        from botocore.exceptions import ClientError

        extra = {"IfMatch": self.etag} if (self.blocks is not None or self.pinned) and self.etag else {}
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={first}-{end - 1}",
                                          **extra)["Body"].read()
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("412", "PreconditionFailed"):
                raise DataError(f"data.path {self.uri!r} changed while the job read it (its ETag is no longer "
                                f"{self.etag}); a job trains on one version of its data: restart it, or write new "
                                "data under a new key") from None
            raise
        with self._count:
            self.bytes_read += len(body)
            self.requests += 1
        return body


class CacheConfig:
    """Where a node keeps the blocks of S3 data it has read, and how much: `root` (a folder on local disk, shared
    by the node's worker processes), `max_bytes` (least recently used blocks go past it), `block_bytes`."""

    def __init__(self, max_bytes: int, block_bytes: int, root: str | None = None):
        self.max_bytes, self.block_bytes = int(max_bytes), max(1, int(block_bytes))
        self.root = Path(root or os.environ.get("HETSPOT_DATA_CACHE")
                         or Path(tempfile.gettempdir()) / "hetspot-data-cache")

    @classmethod
    def from_data(cls, data: dict) -> CacheConfig | None:
        """The job's `data` section (as the workers receive it) to a config; None where the cache is off."""
        gb = float(data.get("cache_gb", 0) or 0)
        if gb <= 0:
            return None
        return cls(int(gb * 2**30), int(float(data.get("block_mib", 1.0)) * 2**20), data.get("cache_dir"))


class BlockCache:
    """An S3 object's blocks as files under the node's cache folder (one folder per object version).

    A read takes the bytes it needs from the blocks it spans; a block that is not on disk is fetched once (threads
    of one process asking for the same block share one GET) and written under a temporary name then renamed, so
    another process never sees half a block. After a write, when the folder may have outgrown `max_bytes`, the
    least recently used blocks (by modification time, touched on every hit) are deleted, across every object the
    node caches. A block deleted while another process reads it stays readable to that process (POSIX), and one
    deleted between listing and opening is fetched again."""

    def __init__(self, config: CacheConfig, array: S3Array):
        self.config, self.array, self.block = config, array, config.block_bytes
        name = f"{array.bucket}/{array.key}@{array.etag}:{array.size_bytes}:{self.block}"
        self.dir = config.root / hashlib.sha256(name.encode()).hexdigest()[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "object.txt").write_text(name + "\n")
        self.hits = self.misses = 0
        self._fetching: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._written_since_check = 0

    def read(self, first: int, end: int) -> bytes:
        parts = []
        for b in range(first // self.block, (end - 1) // self.block + 1):
            lo, hi = max(first, b * self.block) - b * self.block, min(end, (b + 1) * self.block) - b * self.block
            parts.append(self._slice(b, lo, hi))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _slice(self, b: int, lo: int, hi: int) -> bytes:
        path = self.dir / f"{b}.blk"
        try:
            with open(path, "rb") as f:
                f.seek(lo)
                got = f.read(hi - lo)
            os.utime(path)  # recently used: the eviction keeps it
            with self._lock:
                self.hits += 1
            return got
        except FileNotFoundError:
            return self._fetch(b)[lo:hi]

    def _fetch(self, b: int) -> bytes:
        with self._lock:
            theirs = self._fetching.get(b)
            if theirs is None:
                fut: Future = Future()
                self._fetching[b] = fut
                self.misses += 1
        if theirs is not None:
            return theirs.result()
        try:
            body = self.array.get_range(b * self.block, min(self.array.size_bytes, (b + 1) * self.block))
            tmp = self.dir / f".{b}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, self.dir / f"{b}.blk")
            fut.set_result(body)
        except BaseException as e:
            fut.set_exception(e)
            raise
        finally:
            with self._lock:
                self._fetching.pop(b, None)
        with self._lock:
            self._written_since_check += len(body)
            check = self._written_since_check >= max(self.block, self.config.max_bytes // 64)
            if check:
                self._written_since_check = 0
        if check:
            evict(self.config.root, self.config.max_bytes)
        return body


def evict(root: Path, max_bytes: int) -> int:
    """Deletes the least recently used blocks under `root` until they total at most `max_bytes`; returns the bytes
    freed. Safe beside other processes reading and writing there (a missing file is skipped)."""
    blocks = []
    for p in root.glob("*/*.blk"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        blocks.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in blocks)
    freed = 0
    for _, size, p in sorted(blocks):
        if total - freed <= max_bytes:
            break
        try:
            p.unlink()
            freed += size
        except FileNotFoundError:
            continue
    return freed


RETRIES = {"mode": "standard", "max_attempts": 8}  # 503 SlowDown and throttling back off with jitter


_LOADER = None  # botocore's loader of service models, shared by every session this process makes


def _session():
    """A fresh boto3 session that reads its service models through one loader per process. The session looks
    its credentials up anew; what it shares is botocore's parsed JSON (S3's model and the endpoint rules), which
    a session of its own parses again: 0.13-0.30 s of CPU a client, against 0.025 s with the loader shared
    (measured here, warm process)."""
    global _LOADER
    import boto3
    import botocore.session
    from botocore.loaders import create_loader

    if _LOADER is None:
        _LOADER = create_loader()
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core)


_URL = re.compile(r"(?P<scheme>\b[a-z][a-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]*@)?(?P<rest>[^\s'\"?#]*)"
                  r"(?P<query>\?[^\s'\"#]*)?", re.IGNORECASE)


def redact(text: object) -> str:
    """`text` with every URL's user info and query string masked (an endpoint URL may carry a password; a
    presigned URL carries a signature): what hetspot prints or logs about an endpoint goes through here."""
    def one(m: re.Match) -> str:
        return m["scheme"] + ("***@" if m["userinfo"] else "") + m["rest"] + ("?***" if m["query"] else "")
    return _URL.sub(one, str(text))


def new_s3_client(endpoint_url: str | None = None, config=None):
    """An S3 client from a fresh boto3 session (credentials are looked up now: boto3's default session would
    keep the first ones it found for the life of the process), with the standard retry mode; `config` (a
    botocore Config) is merged over it. The checkpoints (orchestrator/state/s3_store.py) use it too."""
    from botocore.config import Config

    attempts = os.environ.get("AWS_MAX_ATTEMPTS")  # botocore's own knob: a user (or a test) may lower it
    retries = Config(retries=RETRIES | ({"max_attempts": int(attempts)} if attempts and attempts.isdigit() else {}))
    return _session().client("s3", endpoint_url=endpoint_url,
                             config=retries if config is None else retries.merge(config))
