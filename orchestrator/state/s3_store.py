"""The S3 tier's I/O: one safetensors object per canonical unit (or TP slice of one) per step, a manifest last.

Layout under `s3://BUCKET/PREFIX/`:
    step-0000000041/units/<unit>/<region>.run-<run id>.safetensors   tensors "param", "exp_avg", "exp_avg_sq"
    step-0000000041/manifest.json                                     written last, with If-None-Match: *
    .hetspot-leases/step-0000000041/<reader>.<expiry>                 a reader's hold: pruning waits for it
The prefix is a directory: `s3://b/job1` is `job1/` and never sees `job10/`. A region is the slice of the full
tensor an object holds (`0-64.0-32`: rows 0-64, columns 0-32), so the keepers upload the TP shards they hold
without gathering them, and a reader cuts out what its layout needs. What a manifest says and what makes a step
whole, readable and this run's is orchestrator/state/manifest.py; this module reads and writes.

A bucket is hostile, so a step counts only when its bytes are there and are this run's:
  - every read of a piece is verified against the manifest (SHA256, size, then its tensors against the region:
    moto, like some S3-compatible stores, does not check checksums, so the client must); any read error (a
    missing key, access denied, throttled past the retries) refuses that step by name, and every reader
    (`load_latest`, the tier restore, `verify`, `export`, the resume choice) falls back to the previous good one;
  - pruning (`keep_newest`) counts only this run's steps that are whole and readable (a listing of the prefix
    matched against each manifest), never deletes a step it cannot attribute or could not read this time, never
    deletes under a reader's lease, aborts interrupted multipart uploads, and reports every key a delete left;
  - a delete removes the manifest on its own first (the step stops existing before its data goes) and reads
    every per-key error of DeleteObjects: a step whose delete failed is reported, never counted deleted;
  - a manifest PUT answered 412 after a retry (the first try committed, its answer was lost) is read back and
    accepted when it is this write.
safetensors, never pickle: loading a checkpoint from a shared bucket cannot run code. Credentials come from
boto3's standard chain (environment, profile, instance role) and are never logged.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.errors import (  # raised here; importers may take it from here
    CheckpointError,
    Refusal,
    WriterConflict,
)
from orchestrator.state.manifest import (
    FORMAT,
    ITEMSIZE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SAFETENSORS_HEADER_MAX,
    Identity,
    expected_units,
    manifest_identity,
    missing_units,
    parse_manifest,
    piece_key,
    piece_problems,
    piece_run,
    region_tag,
    same_write,
    step_dir,
    stored,
    unlisted,
)
from workers.s3_data import redact
from workers.transfer import CheckpointLocation

__all__ = ["CheckpointError", "Identity", "Refusal", "S3Checkpoints", "StepInfo", "StepStatus", "region_tag",
           "missing_units", "expected_units", "parse_uri", "check_access", "new_client", "FORMAT"]

MULTIPART_BYTES = 8 << 20
VERIFY_CHUNK = 8 << 20  # `check_piece` streams a piece in chunks of this size
CONNECTIONS = 16  # concurrent ranged GETs of one piece, and parts of one upload in flight (bench/s3_restore.py)
PART_BYTES = 8 << 20  # a ranged GET's size
LEASE_TTL_S = 900.0  # a reader's hold on a step; renewed while it reads, so only a dead reader's lapses
LEASES = ".hetspot-leases"
WRITERS = ".hetspot-writers"
WRITER_TTL_S = 60.0  # a run's writer lock: renewed every 15 s while the job runs; a dead writer's lapses
_CONFLICT = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_STEP = re.compile(r"step-(\d{10})/(.+)$")
_LEASE = re.compile(r"step-(\d{10})/(.+)\.(\d+)$")
_ABSENT = ("404", "NoSuchKey", "NotFound")
log = logging.getLogger("hetspot.checkpoints")


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at the ends)."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri or "")
    if not m:
        raise ValueError(f"checkpoint uri {uri!r} must look like s3://BUCKET/PREFIX (a bucket name of 3-63 "
                         "lowercase letters, digits, dots or dashes)")
    prefix = (m.group(2) or "").strip("/")
    bad = [p for p in prefix.split("/") if p in ("", ".", "..")] if prefix else []
    if bad:
        raise ValueError(f"checkpoint uri {uri!r}: the prefix has an empty, '.' or '..' segment, which S3 stores "
                         "literally (it is not a path); write the prefix without it, e.g. s3://BUCKET/jobs/NAME")
    return m.group(1), prefix


def s3_code(e: Exception) -> str:
    """S3's error code of a botocore error ("NoSuchKey", "AccessDenied", "SlowDown"...), else its type name."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code") or type(e).__name__)
    return type(e).__name__


HEAD_RETRIES = 5  # a HEAD's own rounds of botocore's retries, after its first, while S3 answers it 503


def head_object(client: Any, **kwargs: Any) -> dict:
    """`client.head_object`, backing off at S3's throttling scale while it answers 503. A 503 to a HEAD has no
    body, so botocore cannot tell SlowDown from any other 503 and backs off at its non-throttling scale (0.05 s
    growing to 3.2 s, about 3 s for its eight attempts in all): its retries end inside a SlowDown episode that
    a GET or PUT outlasts (a drill saw a checkpoint's HEAD give up 2.5 s into 6 s of SlowDown). Here each round of
    botocore's retries that ends in a 503 waits a jittered 1, 2, 4, 8, 16 s before the next."""
    import random

    from botocore.exceptions import ClientError

    for attempt in range(HEAD_RETRIES + 1):
        try:
            return client.head_object(**kwargs)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if attempt == HEAD_RETRIES or status != 503:
                raise
            time.sleep(random.random() * min(20.0, 2.0 ** attempt))
    raise AssertionError("unreachable")


def read_refusal(e: Exception) -> Refusal:
    """A failed read's refusal: a missing object is MISSING (the step is broken); anything else (access denied,
    throttled past the retries, a dropped connection) is UNREADABLE (the step may be fine: never deleted for it)."""
    return Refusal.MISSING if s3_code(e) in _ABSENT else Refusal.UNREADABLE


@dataclass(frozen=True)
class StepInfo:
    step: int
    complete: bool  # a manifest exists
    num_objects: int
    nbytes: int


@dataclass(frozen=True)
class StepStatus:
    """A step with a manifest, as a reader finds it: good (`refusal` None), or refused and why."""

    step: int
    refusal: Refusal | None
    reason: str
    meta: dict = field(default_factory=dict)
    manifest: dict | None = None

    @property
    def ok(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True)
class Deleted:
    """What a delete did: objects removed, and each key left with S3's reason."""

    step: int
    num_deleted: int
    left: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.left


@dataclass(frozen=True)
class Pruned:
    """What `keep_newest` did: steps deleted whole, steps whose delete left keys (retried at the next prune),
    steps kept because a reader holds them, interrupted multipart uploads aborted."""

    deleted: list[int]
    failed: dict[int, list[str]] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)
    aborted_uploads: int = 0


class Lease:
    """A reader's hold on a step (`with store.lease(step):`): an object under `.hetspot-leases/` that pruning
    honours until it is released or its expiry (in its name) passes. `renew` pushes the expiry on. A reader whose
    credentials may not write the bucket reads without one (a warning says so).

    The expiry is on the bucket's clock (the `Date` of S3's answers), not the reader's: a reader whose clock is
    20 minutes slow still holds its step for the TTL, as pruning (which reads the same clock) sees it."""

    def __init__(self, store: S3Checkpoints, step: int, ttl_s: float):
        self.store, self.step, self.ttl_s = store, step, ttl_s
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.key: str | None = None
        self.version: str | None = None  # in a versioned bucket: deleted by version, so no version stays behind
        self.taken_at = 0.0  # on the bucket's clock
        self._renewed = 0.0  # on this machine's monotonic clock: when to renew

    def __enter__(self) -> Lease:
        self.renew(force=True)
        return self

    def renew(self, force: bool = False) -> None:
        if not force and (self.key is None or time.monotonic() - self._renewed < self.ttl_s / 2):
            return
        s = self.store
        now = s.bucket_time()
        key = f"{s.dir}{LEASES}/step-{self.step:010d}/{self.holder}.{math.ceil(now + self.ttl_s)}"  # never short
        try:
            version = s.client.put_object(Bucket=s.bucket, Key=key, Body=b"").get("VersionId")
        except Exception as e:  # noqa: BLE001 - reading goes on without a hold; said once
            if force:
                log.warning("could not take a read lease on step %d in %s (%s): a job pruning this prefix may "
                            "delete the step while it is read", self.step, s.uri, s3_code(e))
            return
        old_key, old_version = self.key, self.version
        self.key, self.version, self.taken_at, self._renewed = key, version, now, time.monotonic()
        if old_key is not None:
            s._delete_quietly(old_key, old_version)

    def __exit__(self, *exc: object) -> None:
        if self.key is not None:
            self.store._delete_quietly(self.key, self.version)
            self.key = None


class WriterLock:
    """One writer per run (`store.claim_writer(run_id, job)`): an object `.hetspot-writers/run-<id>.json` under the
    prefix, written with If-None-Match: * (S3 lets one of two writers have it), renewed (If-Match on its ETag) by a
    thread of its own every quarter TTL while the job runs, and checked before every manifest. Its expiry is on the
    bucket's clock. Two jobs submitted with one run id (`--resume` twice) would otherwise overwrite each other's
    pieces, and pruning could delete the good step for the corrupt one.

    A claim that finds the lock held watches it for up to its TTL: renewed meanwhile, its writer is alive and the
    claim fails (WriterConflict, naming it); lapsed, its writer is gone (a controller that died cannot release it)
    and the run is taken over. So a resume after a lost controller waits at most one TTL (`WRITER_TTL_S`, or
    HETSPOT_WRITER_TTL_S in the environment)."""

    def __init__(self, store: S3Checkpoints, run_id: str, job: str | None, ttl_s: float | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.store, self.run_id, self.job = store, run_id, job
        self.ttl_s = float(ttl_s if ttl_s is not None else os.environ.get("HETSPOT_WRITER_TTL_S", WRITER_TTL_S))
        self.key = f"{store.dir}{WRITERS}/run-{run_id}.json"
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.etag: str | None = None
        self.version: str | None = None  # in a versioned bucket: each renewal's previous version is deleted
        self.started = 0.0
        self.lost: str | None = None  # why the lock is no longer this writer's
        self.sleep = sleep
        self._lock = threading.Lock()  # a renewal and a check never interleave
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self, now: float) -> bytes:
        return json.dumps({"run_id": self.run_id, "job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                           "holder": self.holder, "started": self.started, "expires": now + self.ttl_s}).encode()

    def claim(self) -> WriterLock:
        """Take the run's lock (waiting out a lapsing one), or raise WriterConflict naming the writer that holds
        it and how to take over."""
        from botocore.exceptions import ClientError

        s = self.store
        self.started = now = s.bucket_time()
        cond: dict = {"IfNoneMatch": "*"}
        while True:
            try:
                r = s.client.put_object(Bucket=s.bucket, Key=self.key, Body=self._body(now),
                                        ContentType="application/json", **cond)
                break
            except ClientError as e:
                if s3_code(e) not in _CONFLICT:
                    raise
            there, etag = self._read()
            if there is not None and float(there.get("expires") or 0) > now:
                there, etag = self._wait_out(there, etag)  # raises WriterConflict while its writer renews it
            log.warning("taking over the writer lock of run %s in %s (%s)", self.run_id, s.uri,
                        "it lapsed: its writer is gone" if there is not None else "it names no writer")
            now = s.bucket_time()
            cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}  # unchanged since, or gone
        self.etag, self.version = r.get("ETag"), r.get("VersionId")
        self._thread = threading.Thread(target=self._renew_loop, name="hetspot-writer-lock", daemon=True)
        self._thread.start()
        return self

    def _wait_out(self, there: dict, etag: str | None) -> tuple[dict, str | None]:
        """Watch a held lock until it lapses (returned, to be taken over) or is renewed (WriterConflict)."""
        s = self.store
        wait = max(0.0, float(there["expires"]) - s.bucket_time())
        log.warning("run %s's writer lock in %s is held by %s (host %s); waiting up to %.0f s for it to lapse (a "
                    "writer that died cannot release it) or be renewed (its writer is alive)", self.run_id, s.uri,
                    there.get("holder"), there.get("host"), wait)
        while True:
            now = s.bucket_time()
            if float(there.get("expires") or 0) <= now:
                return there, etag
            self.sleep(min(max(0.5, self.ttl_s / 8), float(there["expires"]) - now + 1.0))
            again, etag2 = self._read()
            if etag2 != etag and again is not None and float(again.get("expires") or 0) > s.bucket_time():
                raise WriterConflict(self._conflict(again))
            if again is None:
                return there, etag2  # released meanwhile (or garbage): taken with the condition that fits
            there, etag = again, etag2

    def _read(self) -> tuple[dict | None, str | None]:
        """The lock as it stands (None where it is not JSON naming a writer) and its ETag (None: it is gone)."""
        s = self.store
        try:
            r = s.client.get_object(Bucket=s.bucket, Key=self.key)
            raw = r["Body"].read(64 << 10)
        except Exception:  # noqa: BLE001 - gone (or unreadable): no writer named, taken with If-None-Match
            return None, None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            body = None
        return (body if isinstance(body, dict) and "expires" in body else None), r.get("ETag")

    def _conflict(self, there: dict) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(there.get("started") or 0)))
        return (f"run {self.run_id} of job {there.get('job')!r} is being written to {self.store.uri} by another "
                f"job (host {there.get('host')}, pid {there.get('pid')}, started {started}): one run has one writer. "
                f"Stop that job first (its lock lapses {self.ttl_s:.0f} s after it stops, and a resume then takes "
                f"over), or, if it is gone, delete {self.store.where(self.key)}; to train apart from it, submit "
                "without --resume")

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except CheckpointError as e:
                log.error("%s", e)
                return
            except Exception as e:  # noqa: BLE001 - S3 refused one renewal: the next may pass before the TTL ends
                log.warning("renewing the writer lock of run %s failed (%s); trying again", self.run_id, s3_code(e))

    def renew(self) -> None:
        """Push the expiry on (If-Match: the lock as this writer last wrote it); CheckpointError if it was taken."""
        from botocore.exceptions import ClientError

        s = self.store
        with self._lock:
            if self.lost:
                raise CheckpointError(self.lost, Refusal.FOREIGN)
            try:
                r = s.client.put_object(Bucket=s.bucket, Key=self.key, Body=self._body(s.bucket_time()),
                                        IfMatch=self.etag, ContentType="application/json")
            except ClientError as e:
                if s3_code(e) in _CONFLICT or s3_code(e) in _ABSENT:
                    self.lost = (f"run {self.run_id}'s writer lock at {s.where(self.key)} was taken by another "
                                 "writer: this job writes no more steps of the run")
                    raise CheckpointError(self.lost, Refusal.FOREIGN) from None
                raise
            old, self.etag, self.version = self.version, r.get("ETag"), r.get("VersionId")
            if old:
                s._delete_quietly(self.key, old)

    def check(self) -> None:
        """Before a manifest: the lock is still this writer's (one HEAD); CheckpointError (FOREIGN) if not. A HEAD
        S3 refuses now (throttled, unreachable) is no verdict: the manifest goes on (its own write would meet the
        same S3), and the renewals, which fail loudly once the lock is taken, keep watching."""
        from botocore.exceptions import BotoCoreError, ClientError

        s = self.store
        with self._lock:
            if self.lost:
                raise CheckpointError(self.lost, Refusal.FOREIGN)
            try:
                etag = s.client.head_object(Bucket=s.bucket, Key=self.key).get("ETag")
            except ClientError as e:
                if s3_code(e) not in _ABSENT:
                    log.info("the writer lock of run %s could not be checked (%s)", self.run_id, s3_code(e))
                    return
                etag = None
            except BotoCoreError as e:
                log.info("the writer lock of run %s could not be checked (%s)", self.run_id, type(e).__name__)
                return
            if etag != self.etag:
                self.lost = (f"run {self.run_id}'s writer lock at {s.where(self.key)} is no longer this job's "
                             "(another writer took it over): this job writes no more steps of the run")
                raise CheckpointError(self.lost, Refusal.FOREIGN)

    def stall(self) -> None:
        """Stop renewing (what a hung or dead writer does); tests and drills use it."""
        self._stop.set()

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still this writer's (If-Match), so the run's next job need
        not wait for it to lapse."""
        self._stop.set()
        s = self.store
        with self._lock:
            if self.lost:
                return
            try:
                if self.version:  # this writer's version only (another's newer one stays current)
                    s.client.delete_object(Bucket=s.bucket, Key=self.key, VersionId=self.version)
                else:
                    s.client.delete_object(Bucket=s.bucket, Key=self.key, IfMatch=self.etag)
            except Exception as e:  # noqa: BLE001 - a lock left behind lapses on its own
                log.info("could not release the writer lock %s (%s)", s.where(self.key), s3_code(e))


class S3Checkpoints:
    def __init__(self, uri: str, endpoint_url: str | None = None, client: Any = None,
                 multipart_bytes: int = MULTIPART_BYTES, lease_ttl_s: float = LEASE_TTL_S,
                 clock: Callable[[], float] = time.time, connections: int = CONNECTIONS,
                 part_bytes: int = PART_BYTES) -> None:
        self.uri, self.endpoint_url = uri, endpoint_url
        self.clock = clock  # this machine's wall clock (used only where S3 gives no Date)
        self.bucket, self.prefix = parse_uri(uri)
        self.connections, self.part_bytes = max(1, connections), max(1, part_bytes)
        if client is None:
            from botocore.config import Config

            client = new_client(endpoint_url, Config(max_pool_connections=max(10, 2 * self.connections)))
        self.client = client
        self.multipart_bytes = multipart_bytes
        self.lease_ttl_s = lease_ttl_s
        self._read_back: set[int] = set()  # steps pruning read back whole and sound (a listing shows sizes only)
        self._versioned: bool | None = None

    @classmethod
    def at(cls, where: CheckpointLocation, **kw: Any) -> S3Checkpoints:
        return cls(where.uri, where.endpoint_url, **kw)

    @property
    def location(self) -> CheckpointLocation:
        """Where these checkpoints are, as one value that crosses process hops (keepers, workers)."""
        return CheckpointLocation(self.uri, self.endpoint_url)

    # -- keys ---------------------------------------------------------------------
    @property
    def dir(self) -> str:
        """The prefix as a directory ("job1/"; "" for the bucket's root): `job1` never lists `job10`'s keys."""
        return f"{self.prefix}/" if self.prefix else ""

    def step_dir(self, step: int) -> str:
        return step_dir(self.prefix, step)

    def _key(self, step: int, rest: str) -> str:
        return self.step_dir(step) + rest if rest else self.step_dir(step).rstrip("/")

    def manifest_key(self, step: int) -> str:
        return self.step_dir(step) + MANIFEST

    def where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def check_write(self, name: str) -> str | None:
        """Write and delete one empty object under the prefix: None when this machine may write the bucket, else
        what S3 answered (each node checks its own access: workers upload with their own credentials)."""
        key = f"{self.dir}.hetspot-access/{name}"
        try:
            version = self.client.put_object(Bucket=self.bucket, Key=key, Body=b"").get("VersionId")
            self.client.delete_object(Bucket=self.bucket, Key=key, **({"VersionId": version} if version else {}))
        except Exception as e:  # noqa: BLE001 - any failure means this node's uploads will fail
            return f"{type(e).__name__}: {e}"
        return None

    # -- write --------------------------------------------------------------------
    def save(self, step: int, state: dict[str, dict], optimizer_steps: float, meta: dict | None = None) -> dict:
        """Upload full canonical tensors (one piece per unit), then the manifest. Returns the manifest.
        The state's units are the model's: a direct save is whole by construction."""
        meta = meta or {}
        shapes = {name: list(t["param"].shape) for name, t in state.items()}
        if self.prepare_step(step, Identity.of(meta, shapes)) == "exists":
            raise CheckpointError(f"step {step} already exists at {self.where(self.manifest_key(step))}; "
                                  "a step is written once")
        pieces = {}
        for name, tensors in sorted(state.items()):
            region = tuple((0, n) for n in tensors["param"].shape)
            pieces[name] = [self.put_piece(step, name, region, tensors, meta.get("run_id"))]
        return self.write_manifest(step, shapes, pieces, optimizer_steps, meta)

    def prepare_step(self, step: int, identity: Identity | str | None = None, bad: bool = False) -> str:
        """Before uploading `step`: "exists" when this identity's whole, readable step is there and not known
        `bad` (it is never touched); else "new", after deleting what stood there when it is this identity's and
        broken (not whole, pieces missing, or refused as corrupt) or its manifest is malformed and names no other
        run (truncated, garbage), its manifest first. A step of another job, run or model, or one whose manifest
        S3 would not let us read now, is never deleted: CheckpointError, not written."""
        if isinstance(identity, str) or identity is None:
            identity = Identity(identity, None, None)
        key = self.manifest_key(step)
        if not self._exists(key):
            return "new"
        status = self._status(step, self._listing(self.step_dir(step)), identity)
        if status.refusal is Refusal.MALFORMED and (foreign := self._claimed_by_other(step, identity)):
            status = StepStatus(step, Refusal.FOREIGN, f"{status.reason}; it names {foreign}")
        if status.refusal in (Refusal.FOREIGN, Refusal.UNREADABLE):
            raise CheckpointError(f"step {step} not written: {self.where(key)} stands ({status.reason})",
                                  status.refusal, step)
        why = "refused as corrupt by a restore" if bad else status.reason if not status.ok else None
        if why is None:
            return "exists"
        log.warning("replacing checkpoint step %d in %s: %s", step, self.uri, why)
        deleted = self.delete_step(step, identity.run_id)
        if self._exists(key):
            raise CheckpointError(f"step {step} not written: its broken manifest could not be deleted "
                                  f"({'; '.join(f'{k}: {c}' for k, c in deleted.left) or 'it is still there'})",
                                  Refusal.UNREADABLE, step)
        return "new"

    def _claimed_by_other(self, step: int, identity: Identity) -> str | None:
        """Whose a manifest this hetspot cannot parse says it is, when that is not `identity` (its `meta.job` and
        `meta.run_id`, if it has them: a newer format of another run is never replaced); None when it names no
        one else (truncated, garbage, or this run's own: its redo replaces it)."""
        try:
            raw = json.loads(self.client.get_object(Bucket=self.bucket, Key=self.manifest_key(step))["Body"].read())
            meta = raw.get("meta") if isinstance(raw, dict) else None
        except Exception:  # noqa: BLE001 - unreadable as JSON: it names no one
            return None
        if not isinstance(meta, dict):
            return None
        claimed = Identity(meta.get("job") if isinstance(meta.get("job"), str) else None,
                           meta.get("run_id") if isinstance(meta.get("run_id"), str) else None, None)
        return identity.foreign(claimed)

    def put_piece(self, step: int, unit: str, region: tuple[tuple[int, int], ...], tensors: dict,
                  run_id: str | None = None) -> dict:
        """Upload one unit's tensors over `region` (torch tensors, or numpy arrays: a keeper's, which never imports
        torch); the manifest entry for it (its key absolute in memory). The object is the same either way."""
        kept = {k: v for k, v in tensors.items() if v is not None}
        if all(isinstance(v, np.ndarray) for v in kept.values()):
            from safetensors.numpy import save as numpy_safetensors

            kept = {k: np.ascontiguousarray(v) for k, v in kept.items()}
            data = numpy_safetensors(kept)
        else:
            from safetensors.torch import save as torch_safetensors

            kept = {k: v.contiguous() for k, v in kept.items()}
            data = torch_safetensors(kept)
        key = piece_key(self.step_dir(step), unit, region, run_id)
        etag, version = self._put(key, data)
        return {"key": key, "region": [list(r) for r in region], "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data), "tensors": {k: dtype_name(v) for k, v in sorted(kept.items())}} | (
            {"etag": etag} if etag else {}) | ({"version": version} if version else {})

    def write_manifest(self, step: int, shapes: dict[str, list[int]], pieces: dict[str, list[dict]],
                       optimizer_steps: float, meta: dict | None = None,
                       model_units: dict[str, list[int]] | None = None) -> dict:
        """The step's manifest, written last and only once (If-None-Match: *): the step now exists.

        `model_units` ({unit: full shape}, default `shapes`) is the job's whole model: a manifest whose pieces
        do not cover every one of them, or that lacks the optimizer's moments after its first update, is refused
        with CheckpointError and never written. A 412 is read back: the same write (a committed PUT whose answer
        was lost and retried) is accepted."""
        units = {n: {"shape": list(shapes[n]), "pieces": pieces[n], "bytes": sum(p["bytes"] for p in pieces[n])}
                 for n in sorted(pieces)}
        model_units = {n: list(v) for n, v in sorted((model_units or shapes).items())}
        manifest = {"format": FORMAT, "step": step, "optimizer_steps": optimizer_steps, "written_at": time.time(),
                    "meta": meta or {}, "model_units": model_units, "units": units}
        missing = missing_units(manifest)
        if missing:
            raise CheckpointError(f"step {step} not written: its pieces cover {len(model_units) - len(missing)} of "
                                  f"the model's {len(model_units)} units (missing {', '.join(missing[:5])}"
                                  f"{', ...' if len(missing) > 5 else ''})")
        if optimizer_steps > 0:
            short = [f"{n} ({p['key'].rsplit('/', 1)[-1]})" for n, u in units.items() for p in u["pieces"]
                     if "tensors" in p and not {"exp_avg", "exp_avg_sq"} <= set(p["tensors"])]
            if short:
                raise CheckpointError(f"step {step} not written: pieces of {', '.join(short[:3])} lack the "
                                      f"optimizer's moments after {optimizer_steps:g} updates")
        body = json.dumps(stored(manifest, self.step_dir(step))).encode()
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=self.manifest_key(step), IfNoneMatch="*", Body=body,
                                   ContentType="application/json")
        except ClientError as e:
            if s3_code(e) not in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise
            try:
                there = self.manifest(step)
            except CheckpointError:
                there = None
            if there is None or not same_write(there, manifest):
                who = (there or {}).get("meta", {})
                raise CheckpointError(f"step {step} not written: another manifest is there (run "
                                      f"{who.get('run_id')} of job {who.get('job')!r})", Refusal.FOREIGN,
                                      step) from None
            log.info("step %d's manifest PUT answered %s; it is there and is this write: written", step, s3_code(e))
        return manifest

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            head_object(self.client, Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if s3_code(e) in _ABSENT:
                return False
            raise

    def _put(self, key: str, data: bytes) -> tuple[str | None, str | None]:
        """Upload one object (multipart, parts at once, above `multipart_bytes`): (the ETag S3 answered, which
        every listing shows, so a step whose object was replaced since is not counted whole without reading it;
        its version id in a versioned bucket, which readers then read, not whatever was put there since)."""
        if len(data) < self.multipart_bytes:
            r = self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        else:
            from boto3.s3.transfer import TransferConfig

            cfg = TransferConfig(multipart_threshold=self.multipart_bytes, max_concurrency=self.connections,
                                 multipart_chunksize=max(5 << 20, self.multipart_bytes))
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=cfg)
            r = head_object(self.client, Bucket=self.bucket, Key=key)  # (one writer per run: this upload's)
        return (str(r["ETag"]).strip('"') if r.get("ETag") else None), r.get("VersionId")

    def versioned(self) -> bool:
        """Whether the bucket keeps object versions (asked once; a bucket whose versioning may not be read is
        taken as unversioned, and its versions, if any, are not recorded for multipart pieces)."""
        if self._versioned is None:
            try:
                status = self.client.get_bucket_versioning(Bucket=self.bucket).get("Status")
            except Exception as e:  # noqa: BLE001 - s3:GetBucketVersioning not granted
                log.info("could not read the versioning of %s (%s)", self.bucket, s3_code(e))
                status = None
            self._versioned = status in ("Enabled", "Suspended")
        return self._versioned

    # -- list ---------------------------------------------------------------------
    def _listing(self, under: str | None = None) -> Listing:
        """Every object under the prefix (or the folder `under`): {key: size}, with each one's ETag beside and the
        bucket's clock when S3 answered."""
        out = Listing()
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=under or self.dir)
        for page in pages:
            if out.date is None:
                out.date = _date_of(page, self.clock)
            for o in page.get("Contents", []):
                out[o["Key"]] = o["Size"]
                out.etags[o["Key"]] = str(o.get("ETag", "")).strip('"')
        return out

    def steps(self, listing: dict[str, int] | None = None) -> list[StepInfo]:
        """Every step folder under the prefix, newest first, complete (a manifest exists) or not."""
        found: dict[int, list] = {}
        for key, size in (self._listing() if listing is None else listing).items():
            m = _STEP.fullmatch(key[len(self.dir):])  # directly under the prefix, not a sub-folder
            if m:
                found.setdefault(int(m.group(1)), []).append((m.group(2), size))
        return [StepInfo(s, any(rest == MANIFEST for rest, _ in objs), len(objs), sum(n for _, n in objs))
                for s, objs in sorted(found.items(), reverse=True)]

    def complete_steps(self) -> list[int]:
        """Steps with a manifest, newest first (whether they are whole and readable: `survey`)."""
        return [s.step for s in self.steps() if s.complete]

    # -- read ---------------------------------------------------------------------
    def manifest(self, step: int) -> dict:
        """The manifest of `step`, checked and with its pieces' keys in this prefix; CheckpointError if it cannot
        be read (MISSING: gone; UNREADABLE: S3 refused the read; MALFORMED: not a manifest of this step)."""
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.manifest_key(step)
        try:
            resp = self.client.get_object(Bucket=self.bucket, Key=key)
            # Never more than the cap in memory, whatever the object says it is (parse_manifest refuses it).
            raw = resp["Body"].read(MAX_MANIFEST_BYTES + 1)
            resp["Body"].close()
        except (BotoCoreError, ClientError) as e:
            raise CheckpointError(f"{self.where(key)} could not be read ({s3_code(e)})", read_refusal(e),
                                  step) from None
        return parse_manifest(raw, step, self.step_dir(step), self.where(key), _units_of_model)

    def whole_manifest(self, step: int) -> dict:
        """The manifest of `step` when it covers its whole model; CheckpointError naming the missing units if not."""
        m = self.manifest(step)
        missing = missing_units(m)
        if missing:
            raise CheckpointError(f"step {step} is not whole: {len(missing)} of the model's "
                                  f"{len(expected_units(m))} units are missing ({', '.join(missing[:5])}"
                                  f"{', ...' if len(missing) > 5 else ''})", Refusal.NOT_WHOLE, step)
        return m

    def _status(self, step: int, listing: dict[str, int], identity: Identity | None) -> StepStatus:
        try:
            m = self.manifest(step)
        except CheckpointError as e:
            return StepStatus(step, e.refusal or Refusal.MALFORMED, str(e))
        meta = m.get("meta", {})
        why = identity.foreign(manifest_identity(m)) if identity is not None else None
        if why:  # checked first: another run's step is neither judged nor touched
            return StepStatus(step, Refusal.FOREIGN, f"step {step} was {why}", meta, m)
        missing = missing_units(m)
        if missing:
            return StepStatus(step, Refusal.NOT_WHOLE, f"step {step} is not whole: {len(missing)} of the model's "
                              f"{len(expected_units(m))} units are missing ({', '.join(missing[:5])}"
                              f"{', ...' if len(missing) > 5 else ''})", meta, m)
        gone = unlisted(m, listing)
        if gone:
            return StepStatus(step, Refusal.MISSING, f"step {step} is not readable: {len(gone)} of its pieces are "
                              f"gone ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})", meta, m)
        return StepStatus(step, None, "whole and readable", meta, m)

    def survey(self, identity: Identity | None = None, limit: int | None = None,
               listing: dict[str, int] | None = None) -> list[StepStatus]:
        """The steps with a manifest, newest first, each good or refused and why (whole, readable: every piece
        listed at its size; with `identity`, its own), up to the `limit`-th good one. One LIST of the prefix and
        one GET per manifest."""
        listing = self._listing() if listing is None else listing
        out, good = [], 0
        for info in self.steps(listing):
            if not info.complete:
                continue
            st = self._status(info.step, listing, identity)
            out.append(st)
            good += st.ok
            if limit is not None and good >= limit:
                break
        return out

    def usable(self, identity: Identity | None = None, limit: int | None = None) -> tuple[list[dict], list[StepStatus]]:
        """(The manifests of the newest good steps, newest first; the steps refused on the way, each logged)."""
        statuses = self.survey(identity, limit)
        refused = [s for s in statuses if not s.ok]
        for s in refused:
            log.log(logging.INFO if s.refusal is Refusal.FOREIGN else logging.WARNING,
                    "refusing checkpoint step %d in %s: %s", s.step, self.uri, s.reason)
        return [s.manifest for s in statuses if s.ok and s.manifest is not None], refused

    def manifests(self, limit: int | None = None, identity: Identity | None = None) -> list[dict]:
        """The newest good steps' manifests, newest first; refused ones are logged."""
        return self.usable(identity, limit)[0]

    def read_piece(self, step: int, entry: dict, arrays: str = "torch") -> tuple[dict, int]:
        """One piece's tensors, verified against its SHA256 and size in the manifest and then its tensors against
        its region; (tensors, bytes read), as torch tensors or (`arrays="numpy"`, a keeper's) numpy arrays.
        CheckpointError (the step is refused) on any read error or mismatch."""
        from botocore.exceptions import BotoCoreError, ClientError
        from safetensors import SafetensorError

        if arrays == "numpy":
            from safetensors.numpy import load as numpy_load

            from_safetensors: Callable[[bytes], dict] = numpy_load
        else:
            from safetensors.torch import load as torch_load

            from_safetensors = torch_load

        where = self.where(entry["key"])
        try:
            data = self._fetch(step, entry)
        except (BotoCoreError, ClientError) as e:
            raise self._read_error(step, entry, e) from None
        self._check_bytes(step, entry, len(data), hashlib.sha256(data).hexdigest())
        try:
            tensors = from_safetensors(data)
        except SafetensorError as e:
            raise CheckpointError(f"{where} of step {step} is not a safetensors file ({e})", Refusal.CORRUPT,
                                  step) from None
        except KeyError as e:  # numpy has no such dtype (BF16): hetspot's state is float32, so not its piece
            raise CheckpointError(f"{where} of step {step} holds a tensor of dtype {e}, which hetspot's state never "
                                  "has", Refusal.CORRUPT, step) from None
        self._check_tensors(step, entry, {k: (dtype_name(t), tuple(t.shape)) for k, t in tensors.items()})
        return tensors, len(data)

    def _check_bytes(self, step: int, entry: dict, n: int, digest: str) -> None:
        if n != entry["bytes"] or digest != entry["sha256"]:
            raise CheckpointError(f"{self.where(entry['key'])} does not match its SHA256 in the manifest of step "
                                  f"{step} (read {n} bytes with SHA256 {digest[:12]}...; the manifest says "
                                  f"{entry['bytes']} bytes with SHA256 {entry['sha256'][:12]}...)", Refusal.CORRUPT,
                                  step)

    def _check_tensors(self, step: int, entry: dict, found: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        problems = piece_problems(entry, found)
        if problems:
            raise CheckpointError(f"{self.where(entry['key'])} of step {step} does not hold what its manifest says: "
                                  + "; ".join(problems), Refusal.CORRUPT, step)

    def _fetch(self, step: int, entry: dict) -> bytes:
        """A piece's bytes: one GET up to `part_bytes`, else ranged GETs of `part_bytes` over up to `connections`
        connections at once (one S3 connection carries on the order of 100 MB/s; a node's NIC 100 times that:
        bench/s3_restore.py), every part of the version a HEAD saw (If-Match on its ETag)."""
        size = entry["bytes"]
        if size <= self.part_bytes or self.connections <= 1:
            return self._get_piece(step, entry)["Body"].read()
        head = head_object(self.client, Bucket=self.bucket, Key=entry["key"], **_version(entry))
        if head.get("ContentLength") != size:
            raise CheckpointError(f"{self.where(entry['key'])} of step {step} is {head.get('ContentLength')} bytes; "
                                  f"its manifest says {size}", Refusal.CORRUPT, step)
        cond = {"IfMatch": head["ETag"]} if head.get("ETag") else {}

        cond |= _version(entry)

        def part(lo: int) -> bytes:
            hi = min(lo + self.part_bytes, size)
            return self.client.get_object(Bucket=self.bucket, Key=entry["key"], Range=f"bytes={lo}-{hi - 1}",
                                          **cond)["Body"].read()

        starts = range(0, size, self.part_bytes)
        with ThreadPoolExecutor(min(self.connections, len(starts)), thread_name_prefix="hetspot-s3-get") as pool:
            return b"".join(pool.map(part, starts))

    def _get_piece(self, step: int, entry: dict) -> dict:
        """A piece's GET, refused before its body is read when S3 says it is not the manifest's size."""
        resp = self.client.get_object(Bucket=self.bucket, Key=entry["key"], **_version(entry))
        if resp.get("ContentLength", entry["bytes"]) != entry["bytes"]:
            resp["Body"].close()
            raise CheckpointError(f"{self.where(entry['key'])} of step {step} is {resp['ContentLength']} bytes; "
                                  f"its manifest says {entry['bytes']}", Refusal.CORRUPT, step)
        return resp

    def _read_error(self, step: int, entry: dict, e: Exception) -> CheckpointError:
        refusal = read_refusal(e)
        what = "is not in the bucket" if refusal is Refusal.MISSING else "could not be read"
        return CheckpointError(f"{self.where(entry['key'])} of step {step} {what} ({s3_code(e)})", refusal, step)

    def check_piece(self, step: int, entry: dict, chunk_bytes: int = VERIFY_CHUNK) -> int:
        """`read_piece`'s checks, streamed: the SHA256 and size over chunks of `chunk_bytes`, the tensors from the
        safetensors header against the region and the manifest; nothing larger than a chunk and the header is held
        (a 1 GiB piece is checked in a few MiB). Bytes read; CheckpointError as `read_piece`."""
        from botocore.exceptions import BotoCoreError, ClientError

        sha, n, head = hashlib.sha256(), 0, bytearray()
        try:
            resp = self._get_piece(step, entry)
            for chunk in resp["Body"].iter_chunks(chunk_bytes):
                sha.update(chunk)
                n += len(chunk)
                if len(head) < 8 + SAFETENSORS_HEADER_MAX:
                    head += chunk[:8 + SAFETENSORS_HEADER_MAX - len(head)]
        except (BotoCoreError, ClientError) as e:
            raise self._read_error(step, entry, e) from None
        self._check_bytes(step, entry, n, sha.hexdigest())
        found = safetensors_header(bytes(head), n)
        if isinstance(found, str):
            raise CheckpointError(f"{self.where(entry['key'])} of step {step} is not a safetensors file ({found})",
                                  Refusal.CORRUPT, step)
        self._check_tensors(step, entry, found)
        return n

    def read_unit(self, manifest: dict, name: str) -> tuple[dict, int]:
        """One unit's full tensors from its pieces, each verified; (tensors, bytes read)."""
        import torch

        entry = manifest["units"][name]
        full: dict = {}
        nbytes = 0
        for piece in entry["pieces"]:
            tensors, n = self.read_piece(manifest["step"], piece)
            nbytes += n
            idx = tuple(slice(a, b) for a, b in piece["region"])
            for k, t in tensors.items():
                full.setdefault(k, torch.empty(entry["shape"], dtype=t.dtype))[idx] = t
        return full, nbytes

    def load(self, step: int, names: list[str] | None = None) -> tuple[dict, float, int]:
        """(state by unit name, optimizer steps, bytes read) of a whole step, read under a lease (pruning waits);
        CheckpointError if it cannot be used."""
        with self.lease(step) as lease:
            m = self.whole_manifest(step)
            # Every piece listed at its size before anything is allocated for the step (a manifest may declare
            # units far larger than what the bucket holds).
            gone = unlisted(m, self._listing(self.step_dir(step)))
            if gone:
                raise CheckpointError(f"step {step} is not readable: {len(gone)} of its pieces are gone or not as "
                                      f"written ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''})",
                                      Refusal.MISSING, step)
            state, nbytes = {}, 0
            for name in names if names is not None else sorted(m["units"]):
                tensors, n = self.read_unit(m, name)
                state[name] = {k: tensors.get(k) for k in ("param", "exp_avg", "exp_avg_sq")}
                nbytes += n
                lease.renew()
        return state, float(m["optimizer_steps"]), nbytes

    def load_latest(self, identity: Identity | None = None) -> tuple[int, dict, float, int] | None:
        """The newest good step that loads: (step, state, optimizer steps, bytes read), or None. Each refused
        step is logged by name, and the previous one tried."""
        for m in self.manifests(identity=identity):
            try:
                state, opt_steps, nbytes = self.load(m["step"])
            except CheckpointError as e:
                log.warning("refusing checkpoint step %d: %s; trying the previous complete step", m["step"], e)
                continue
            return m["step"], state, opt_steps, nbytes
        return None

    def verify(self, step: int) -> list[str]:
        """Problems found checking a step (empty: it is sound): its manifest, the model's every unit covered,
        every piece in the bucket, and every piece re-read against its checksum and its region. A read S3 refuses
        (denied, throttled) is no verdict on the step: it raises CheckpointError (UNREADABLE)."""
        with self.lease(step) as lease:
            try:
                m = self.manifest(step)
            except CheckpointError as e:
                if e.refusal is Refusal.UNREADABLE:
                    raise
                return [str(e)]
            missing = missing_units(m)
            problems = [f"step {step} is not whole: the manifest lacks {len(missing)} of the model's "
                        f"{len(expected_units(m))} units: {', '.join(missing)}"] if missing else []
            for name in sorted(m["units"]):
                for piece in m["units"][name]["pieces"]:
                    try:
                        self.check_piece(step, piece)
                    except CheckpointError as e:
                        if e.refusal is Refusal.UNREADABLE:
                            raise
                        problems.append(str(e))
                    lease.renew()
        return problems

    def newest_whole(self, identity: Identity | None = None) -> tuple[int, dict] | None:
        """(the newest good step: whole, every piece there, with `identity` its own; its manifest's meta), or
        None when there is none."""
        found = self.manifests(limit=1, identity=identity)
        return (found[0]["step"], found[0].get("meta", {})) if found else None

    # -- the run's writer ---------------------------------------------------------
    def claim_writer(self, run_id: str, job: str | None = None, ttl_s: float | None = None) -> WriterLock:
        """This job as the one writer of `run_id` under the prefix (WriterConflict if another one is)."""
        return WriterLock(self, run_id, job, ttl_s).claim()

    # -- leases -------------------------------------------------------------------
    def lease(self, step: int, ttl_s: float | None = None) -> Lease:
        return Lease(self, step, self.lease_ttl_s if ttl_s is None else ttl_s)

    def bucket_time(self) -> float:
        """The bucket's clock now: the `Date` of S3's answer to a HEAD of the bucket (one-second resolution, which
        a lease's TTL of minutes does not feel); this machine's clock where S3 gives none."""
        try:
            return _date_of(self.client.head_bucket(Bucket=self.bucket), self.clock)
        except Exception as e:  # noqa: BLE001 - a reader that may not HEAD the bucket leases on its own clock
            log.info("no clock from %s (%s): leases use this machine's", self.uri, s3_code(e))
            return self.clock()

    def leased_steps(self, now: float | None = None) -> set[int]:
        """Steps a reader holds now (leases not yet expired), `now` on the bucket's clock (default: the `Date` of
        the listing's own answer)."""
        under = f"{self.dir}{LEASES}/"
        listing = self._listing(under)
        if now is None:
            now = listing.date if listing.date is not None else self.clock()
        held = set()
        for key in listing:
            m = _LEASE.fullmatch(key[len(under):])
            if m and int(m.group(3)) > now:
                held.add(int(m.group(1)))
        return held

    def _delete_quietly(self, key: str, version: str | None = None) -> None:
        """Delete `key` (its `version` only, where given: in a versioned bucket nothing stays behind)."""
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key, **({"VersionId": version} if version else {}))
        except Exception as e:  # noqa: BLE001 - a lease left behind expires on its own
            log.info("could not delete %s (%s)", self.where(key), s3_code(e))

    # -- delete -------------------------------------------------------------------
    def delete_step(self, step: int, run_id: str | None = None) -> Deleted:
        """Delete a step: its interrupted multipart uploads, then its manifest on its own (the step stops existing
        before its data goes; if the manifest stays, nothing else is touched), then its pieces (with `run_id`,
        only that run's and older formats' pieces), reading every per-key error of DeleteObjects."""
        from botocore.exceptions import ClientError

        folder = self.step_dir(step)
        self._abort_uploads(folder, run_id)
        key = self.manifest_key(step)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if s3_code(e) not in _ABSENT:
                return Deleted(step, 0, [(key, s3_code(e))])
        keys = [k for k in self._listing(folder) if k != key and (run_id is None or piece_run(k) in (None, run_id))]
        left = self._delete_keys(keys)
        if not left and self.versioned():
            self._purge_versions(folder, {key, *keys}, run_id)
        return Deleted(step, 1 + len(keys) - len(left), left)

    def _purge_versions(self, folder: str, keys: set[str], run_id: str | None) -> None:
        """In a versioned bucket a delete only adds a delete marker and the bytes stay (billed): every version and
        marker in the deleted step's folder goes too (with `run_id`, only that run's pieces and the manifest's)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            pages = self.client.get_paginator("list_object_versions").paginate(Bucket=self.bucket, Prefix=folder)
            doomed = [{"Key": v["Key"], "VersionId": v["VersionId"]} for page in pages
                      for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
                      if v["Key"] in keys or run_id is None or piece_run(v["Key"]) in (None, run_id)]
        except (BotoCoreError, ClientError) as e:
            log.warning("%s keeps object versions and their listing was refused (%s): the deleted step's older "
                        "versions stay billed; grant s3:ListBucketVersions and s3:DeleteObjectVersion, or add a "
                        "lifecycle rule expiring noncurrent versions (docs/recovery.md)", self.uri, s3_code(e))
            return
        for k, code in self._delete_objects(doomed):
            log.warning("a version of %s was not deleted (%s): it stays billed until a lifecycle rule expires it",
                        self.where(k), code)

    def _delete_keys(self, keys: list[str]) -> list[tuple[str, str]]:
        """Delete `keys` in batches of 1,000; the keys S3 did not delete, each with its error code (DeleteObjects
        answers 200 with an error entry per key it refused)."""
        return self._delete_objects([{"Key": k} for k in keys])

    def _delete_objects(self, objects: list[dict]) -> list[tuple[str, str]]:
        left = []
        for i in range(0, len(objects), 1000):
            batch = objects[i:i + 1000]
            try:
                resp = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
            except Exception as e:  # noqa: BLE001 - the whole batch stays; reported, retried by the next prune
                left += [(o["Key"], s3_code(e)) for o in batch]
                continue
            left += [(err.get("Key", "?"), err.get("Code", "?")) for err in resp.get("Errors", [])]
        return left

    def _abort_uploads(self, under: str, run_id: str | None = None, before: int | None = None) -> int:
        """Abort the multipart uploads under `under` (with `run_id`, that run's only; with `before`, in step folders
        older than that step): an interrupted upload's parts are billed until aborted, and no listing shows them."""
        from botocore.exceptions import BotoCoreError, ClientError

        n = 0
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=under)
        try:
            listed = [up for page in pages for up in page.get("Uploads", [])]
        except (BotoCoreError, ClientError) as e:  # the deletes and pruning go on without it
            log.warning("could not list the interrupted multipart uploads under %s (%s): their parts stay billed "
                        "until aborted; grant the job's credentials s3:ListBucketMultipartUploads on the bucket and "
                        "s3:AbortMultipartUpload on the prefix", self.where(under), s3_code(e))
            return 0
        for up in listed:
            m = _STEP.fullmatch(up["Key"][len(self.dir):])
            if before is not None and (m is None or int(m.group(1)) >= before):
                continue
            if run_id is not None and piece_run(up["Key"]) not in (None, run_id):
                continue
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                n += 1
            except Exception as e:  # noqa: BLE001 - aborted at the next prune
                log.warning("could not abort the upload of %s (%s)", self.where(up["Key"]), s3_code(e))
        return n

    def keep_newest(self, keep: int, identity: Identity | None = None) -> Pruned:
        """Keep the newest `keep` good steps of `identity` (None: every step counts as its own). Delete its older
        good steps, its steps shown broken (not whole, pieces gone), its half-written folders and interrupted
        uploads older than the newest good step (newer ones may be uploads in flight). Never counted nor deleted:
        another job's, run's or model's step, a step whose manifest could not be read this time or cannot be
        attributed, and a step a reader holds (deleted at a later prune, once released)."""
        listing = self._listing()
        kept: list[int] = []
        doomed: list[int] = []
        good: list[int] = []
        for st in self.survey(identity, listing=listing):
            if st.refusal in (Refusal.FOREIGN, Refusal.UNREADABLE, Refusal.MALFORMED):
                if st.refusal is not Refusal.FOREIGN:
                    log.warning("not pruning checkpoint step %d: %s", st.step, st.reason)
                continue
            (good if st.ok else doomed).append(st.step)
        # A listing shows a piece's size, not its bytes (a byte flipped in place, an older object version put
        # back): before an older good step goes, the steps that stay are read back once (`verify`) and a broken
        # one does not count. A read S3 refuses now leaves every good step where it is.
        for step in good:
            if len(kept) == keep:
                doomed.append(step)
                continue
            if len(good) <= keep or step in self._read_back:
                kept.append(step)
                continue
            try:
                problems = self.verify(step)
            except CheckpointError as e:
                log.warning("not pruning older steps of %s: step %d could not be read back (%s)", self.uri, step, e)
                kept += [g for g in good if g not in kept]
                break
            if problems:
                log.warning("checkpoint step %d of %s is not sound when read back (%s): it does not count",
                            step, self.uri, problems[0])
                doomed.append(step)
            else:
                self._read_back.add(step)
                kept.append(step)
        run_id = identity.run_id if identity is not None else None
        aborted = 0
        if kept:  # half-written folders of this run (or an older format) behind its newest good step
            runs: dict[int, set] = {}
            for key in listing:
                m = _STEP.fullmatch(key[len(self.dir):])
                if m:
                    runs.setdefault(int(m.group(1)), set()).add(piece_run(key))
            doomed += [i.step for i in self.steps(listing) if not i.complete and i.step < kept[0]
                       and runs.get(i.step, set()) & {None, run_id}]
            aborted = self._abort_uploads(self.dir, run_id, before=kept[0])
        doomed = [d for d in doomed if d not in kept]
        held = self.leased_steps() & set(doomed) if doomed else set()
        deleted, failed = [], {}
        for step in sorted(set(doomed) - held):
            result = self.delete_step(step, run_id)
            if result.ok:
                deleted.append(step)
            else:
                failed[step] = [f"{k} ({c})" for k, c in result.left]
                log.warning("pruning checkpoint step %d of %s left %d objects (%s); the next prune tries again",
                            step, self.uri, len(result.left), ", ".join(failed[step][:3]))
        for step in sorted(held):
            log.info("not pruning checkpoint step %d of %s yet: a reader holds it", step, self.uri)
        return Pruned(deleted, failed, sorted(held), aborted)


_SAFETENSORS_DTYPES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16", "F16": "float16", "I64": "int64",
                      "I32": "int32"}


def safetensors_header(head: bytes, size: int) -> dict[str, tuple[str, tuple[int, ...]]] | str:
    """The tensors ({name: (dtype, shape)}) a safetensors file of `size` bytes says it holds, from its first bytes
    (`head`: the 8-byte header length and the JSON header); or what is wrong with it. Each tensor's data must lie
    in the file, be as long as its shape and dtype say, and the data must end where the file does."""
    if len(head) < 8:
        return "shorter than its header length"
    n = int.from_bytes(head[:8], "little")
    if n > SAFETENSORS_HEADER_MAX or 8 + n > len(head):
        return f"its header claims {n} bytes"
    try:
        header = json.loads(head[8:8 + n], parse_constant=lambda c: None)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    found, end = {}, 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(t, dict) and t.get("dtype") in _SAFETENSORS_DTYPES and isinstance(t.get("shape"), list)
                and all(isinstance(x, int) and x >= 0 for x in t["shape"]) and isinstance(t.get("data_offsets"), list)
                and len(t["data_offsets"]) == 2 and all(isinstance(x, int) for x in t["data_offsets"])):
            return f"tensor {name!r} has no dtype hetspot writes, shape or data offsets"
        dtype = _SAFETENSORS_DTYPES[t["dtype"]]
        a, b = t["data_offsets"]
        if not 0 <= a <= b or b - a != math.prod(t["shape"]) * ITEMSIZE[dtype]:
            return f"tensor {name!r}'s data offsets do not match its shape"
        found[name], end = (dtype, tuple(t["shape"])), max(end, b)
    if 8 + n + end != size:
        return f"its tensors end at byte {8 + n + end}, the file at {size}"
    return found


class Listing(dict):
    """A listing: {key: size}, `etags` {key: ETag} beside it, and `date`: the bucket's clock at its answer."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.etags: dict[str, str] = {}
        self.date: float | None = None


def _version(entry: dict) -> dict:
    """The GET/HEAD argument that reads the object version a manifest entry recorded (none: the current one)."""
    return {"VersionId": entry["version"]} if entry.get("version") else {}


def _date_of(response: dict, clock: Callable[[], float]) -> float:
    """The time S3 answered (its `Date` header), or `clock()` where the answer has none."""
    from email.utils import parsedate_to_datetime

    date = response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        return parsedate_to_datetime(date).timestamp() if date else clock()
    except (TypeError, ValueError):
        return clock()


def dtype_name(t: Any) -> str:
    """A tensor's dtype as a manifest records it ("float32", "bfloat16")."""
    return str(t.dtype).removeprefix("torch.")


def _units_of_model(model: dict) -> dict[str, list[int]]:
    """A format-2 manifest's unit list, from the model its meta records."""
    from planner.specs import ModelSpec
    from workers.param_specs import all_params

    return {p.name: list(p.shape) for p in all_params(ModelSpec(**model))}


def new_client(endpoint_url: str | None = None, config: Any = None) -> Any:
    """An S3 client with fresh credentials and the standard retry mode (workers/s3_data.new_s3_client)."""
    from workers.s3_data import new_s3_client

    return new_s3_client(endpoint_url, config)


def check_access(uri: str, endpoint_url: str | None = None, timeout_s: float = 5.0) -> S3Checkpoints:
    """Fail fast, before any worker starts, on what would make every upload fail.

    Raises ValueError naming the `checkpoint:` field and the fix for a missing
    bucket, missing credentials, an unreachable endpoint or refused access.
    """
    from botocore.config import Config
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    bucket, _ = parse_uri(uri)
    cfg = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 1})
    client = new_client(endpoint_url, cfg)
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise ValueError("checkpoint.uri: no AWS credentials were found (boto3 looks at the environment, "
                         "~/.aws profiles and the instance role); set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE") from None
    except EndpointConnectionError as e:
        raise ValueError(f"checkpoint.endpoint_url: cannot reach the S3 endpoint ({redact(e)}); check the URL and that "
                         "the service is up, or drop endpoint_url to use AWS") from None
    except ClientError as e:
        code = s3_code(e)
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise ValueError(f"checkpoint.uri: bucket {bucket!r} does not exist at "
                             f"{redact(endpoint_url or 'AWS')}; create it (`aws s3 mb s3://{bucket}`) or fix the "
                             "name") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ValueError(f"checkpoint.uri: access to bucket {bucket!r} was refused ({code}); check the "
                             "credentials and the bucket policy") from None
        raise ValueError(f"checkpoint.uri: the S3 endpoint answered {code} for bucket {bucket!r}") from None
    return S3Checkpoints(uri, endpoint_url)
