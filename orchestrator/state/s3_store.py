"""The S3 tier: one safetensors object per canonical unit (or TP slice of one) per step, a manifest last.

Layout under `s3://BUCKET/PREFIX/`:
    step-0000000041/units/<parameter name>/<region>.safetensors   tensors "param", "exp_avg", "exp_avg_sq"
    step-0000000041/manifest.json                                  written last, with If-None-Match: *
The prefix is a directory: `s3://b/job1` is `job1/` and never sees `job10/`. A region is the slice of the full tensor an object holds (`0-64.0-32`: rows
0-64, columns 0-32), so the keepers upload the TP shards they hold without
gathering them anywhere, and a reader cuts out what its own layout needs. The
manifest lists, per unit, its full shape and its pieces (key, region, SHA256,
size), the model's whole unit list (`model_units`, from the job's model, not from
whoever answered) and the job that wrote it (`meta.job`, `meta.run_id`). A step
without a manifest does not exist: a writer that dies mid-upload leaves objects no
reader will use; and a manifest is written only when its pieces cover every unit of
`model_units` (`write_manifest` refuses otherwise), so a step that exists is whole.
A step found not whole or refused as corrupt is replaced by deleting it (manifest
first) before its redo is uploaded (`prepare_step`). The manifest holds every object's SHA256 and size,
and every read is verified against it (moto, like some S3-compatible stores,
does not check checksums, so the client must); a mismatch or an unreadable
manifest refuses that step with a log line naming the object, and
`load_latest` falls back to the previous complete step. safetensors, never
pickle: loading a checkpoint from a shared bucket cannot run code. Objects
above `multipart_bytes` go up in parts. Credentials come from boto3's standard
chain (environment, profile, instance role) and are never logged.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import time
from dataclasses import dataclass

from orchestrator.errors import CheckpointError  # raised here; importers may take it from here

FORMAT = "hetspot-checkpoint/3"
READ_FORMATS = ("hetspot-checkpoint/2", FORMAT)  # /2 has no model_units: they come from meta.model
MULTIPART_BYTES = 8 << 20
_STEP = re.compile(r"step-(\d{10})/(.+)$")
log = logging.getLogger("hetspot.checkpoints")


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at the ends)."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?", uri or "")
    if not m:
        raise ValueError(f"checkpoint uri {uri!r} must look like s3://BUCKET/PREFIX (a bucket name of 3-63 "
                         "lowercase letters, digits, dots or dashes)")
    return m.group(1), (m.group(2) or "").strip("/")


@dataclass(frozen=True)
class StepInfo:
    step: int
    complete: bool  # a manifest exists
    num_objects: int
    nbytes: int


class S3Checkpoints:
    def __init__(self, uri: str, endpoint_url: str | None = None, client=None,
                 multipart_bytes: int = MULTIPART_BYTES):
        self.uri, self.endpoint_url = uri, endpoint_url
        self.bucket, self.prefix = parse_uri(uri)
        self.client = client or new_client(endpoint_url)
        self.multipart_bytes = multipart_bytes

    # -- keys ---------------------------------------------------------------------
    @property
    def dir(self) -> str:
        """The prefix as a directory ("job1/"; "" for the bucket's root): `job1` never lists `job10`'s keys."""
        return f"{self.prefix}/" if self.prefix else ""

    def _key(self, step: int, rest: str) -> str:
        return "/".join(x for x in (self.prefix, f"step-{step:010d}", rest) if x)

    def check_write(self, name: str) -> str | None:
        """Write and delete one empty object under the prefix: None when this machine may write the bucket, else
        what S3 answered (each node checks its own access: workers upload with their own credentials)."""
        key = f"{self.dir}.hetspot-access/{name}"
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"")
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - any failure means this node's uploads will fail
            return f"{type(e).__name__}: {e}"
        return None

    def manifest_key(self, step: int) -> str:
        return self._key(step, "manifest.json")

    # -- write --------------------------------------------------------------------
    def save(self, step: int, state: dict[str, dict], optimizer_steps: float, meta: dict | None = None) -> dict:
        """Upload full canonical tensors (one piece per unit), then the manifest. Returns the manifest.
        The state's units are the model's: a direct save is whole by construction."""
        if self.prepare_step(step, (meta or {}).get("job")) == "exists":
            raise CheckpointError(f"step {step} already exists at s3://{self.bucket}/{self.manifest_key(step)}; "
                                  "a step is written once")
        pieces, shapes = {}, {}
        for name, tensors in sorted(state.items()):
            shapes[name] = list(tensors["param"].shape)
            region = tuple((0, n) for n in tensors["param"].shape)
            pieces[name] = [self.put_piece(step, name, region, tensors)]
        return self.write_manifest(step, shapes, pieces, optimizer_steps, meta)

    def prepare_step(self, step: int, job: str | None = None, bad: bool = False) -> str:
        """Before uploading `step`: "exists" when a whole, readable manifest of this job (`job`; None: any) is
        there and not known `bad` (a complete step is never touched); else "new", after deleting what stood
        there (a step left not whole, refused as corrupt, or unreadable), its manifest first."""
        if not self._exists(self.manifest_key(step)):
            return "new"
        try:
            m, why = self.manifest(step), None
        except CheckpointError as e:
            m, why = None, str(e)
        if m is not None:
            owner = m.get("meta", {}).get("job")
            if job is not None and owner not in (None, job):
                raise CheckpointError(f"step {step} at {self.uri} belongs to job {owner!r}, not {job!r}")
            missing = missing_units(m)
            if bad:
                why = "refused as corrupt"
            elif missing:
                why = f"not whole (missing {len(missing)} units: {', '.join(missing[:3])})"
        if why is None:
            return "exists"
        log.warning("replacing checkpoint step %d in %s: %s", step, self.uri, why)
        self.delete_step(step)
        return "new"

    def put_piece(self, step: int, unit: str, region, tensors: dict) -> dict:
        """Upload one unit's tensors over `region`; the manifest entry for it."""
        from safetensors.torch import save as to_safetensors

        data = to_safetensors({k: v.contiguous() for k, v in tensors.items() if v is not None})
        key = self._key(step, f"units/{unit}/{region_tag(region)}.safetensors")
        self._put(key, data)
        return {"key": key, "region": [list(r) for r in region], "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data)}

    def write_manifest(self, step: int, shapes: dict[str, list[int]], pieces: dict[str, list[dict]],
                       optimizer_steps: float, meta: dict | None = None,
                       model_units: dict[str, list[int]] | None = None) -> dict:
        """The step's manifest, written last and only once (If-None-Match: *): the step now exists.

        `model_units` ({unit: full shape}, default `shapes`) is the job's whole model: a manifest whose pieces
        do not cover every one of them is refused with CheckpointError and never written."""
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
        self.client.put_object(Bucket=self.bucket, Key=self.manifest_key(step), IfNoneMatch="*",
                               Body=json.dumps(manifest).encode(), ContentType="application/json")
        return manifest

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _put(self, key: str, data: bytes) -> None:
        if len(data) < self.multipart_bytes:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
            return
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=self.multipart_bytes, multipart_chunksize=max(5 << 20, self.multipart_bytes))
        self.client.upload_fileobj(io.BytesIO(data), self.bucket, key, Config=cfg)

    # -- read ---------------------------------------------------------------------
    def steps(self) -> list[StepInfo]:
        """Every step under the prefix, newest first, complete or not."""
        found: dict[int, list] = {}
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.dir)
        for page in pages:
            for obj in page.get("Contents", []):
                m = _STEP.fullmatch(obj["Key"][len(self.dir):])  # directly under the prefix, not a sub-folder
                if m:
                    found.setdefault(int(m.group(1)), []).append((m.group(2), obj["Size"]))
        return [StepInfo(s, any(rest == "manifest.json" for rest, _ in objs), len(objs), sum(n for _, n in objs))
                for s, objs in sorted(found.items(), reverse=True)]

    def complete_steps(self) -> list[int]:
        return [s.step for s in self.steps() if s.complete]

    def manifest(self, step: int) -> dict:
        key = self.manifest_key(step)
        try:
            m = json.loads(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"s3://{self.bucket}/{key} is not valid JSON (truncated?): {e.msg}") from None
        if not isinstance(m, dict) or m.get("format") not in READ_FORMATS or not isinstance(m.get("units"), dict):
            raise CheckpointError(f"s3://{self.bucket}/{key} is not a {FORMAT} manifest")
        return m

    def whole_manifest(self, step: int) -> dict:
        """The manifest of `step` when it covers its whole model; CheckpointError naming the missing units if not."""
        m = self.manifest(step)
        missing = missing_units(m)
        if missing:
            raise CheckpointError(f"step {step} is not whole: {len(missing)} of the model's "
                                  f"{len(expected_units(m))} units are missing ({', '.join(missing[:5])}"
                                  f"{', ...' if len(missing) > 5 else ''})")
        return m

    def manifests(self, limit: int | None = None) -> list[dict]:
        """The newest complete steps' manifests, newest first; unreadable ones are refused with a log line."""
        out = []
        for step in self.complete_steps():
            try:
                out.append(self.whole_manifest(step))
            except CheckpointError as e:
                log.warning("refusing checkpoint step %d: %s", step, e)
            if limit is not None and len(out) >= limit:
                break
        return out

    def read_piece(self, step: int, entry: dict) -> tuple[dict, int]:
        """One piece's tensors, verified against its SHA256 and size in the manifest; (tensors, bytes read)."""
        from safetensors.torch import load as from_safetensors

        data = self.client.get_object(Bucket=self.bucket, Key=entry["key"])["Body"].read()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry["bytes"] or digest != entry["sha256"]:
            raise CheckpointError(f"s3://{self.bucket}/{entry['key']} does not match its SHA256 in the manifest "
                                  f"of step {step} (read {len(data)} bytes with SHA256 {digest[:12]}...; the "
                                  f"manifest says {entry['bytes']} bytes with SHA256 {entry['sha256'][:12]}...)")
        return from_safetensors(data), len(data)

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
        """(state by unit name, optimizer steps, bytes read) of a whole step; CheckpointError if unusable."""
        m = self.whole_manifest(step)
        state, nbytes = {}, 0
        for name in names if names is not None else sorted(m["units"]):
            tensors, n = self.read_unit(m, name)
            state[name] = {k: tensors.get(k) for k in ("param", "exp_avg", "exp_avg_sq")}
            nbytes += n
        return state, float(m["optimizer_steps"]), nbytes

    def load_latest(self) -> tuple[int, dict, float, int] | None:
        """The newest complete step that verifies: (step, state, optimizer steps, bytes read), or None."""
        for step in self.complete_steps():
            try:
                state, opt_steps, nbytes = self.load(step)
            except CheckpointError as e:
                log.warning("refusing checkpoint step %d: %s; trying the previous complete step", step, e)
                continue
            return step, state, opt_steps, nbytes
        return None

    def verify(self, step: int) -> list[str]:
        """Problems found checking a step: its manifest against the model's unit list (every unit, every region
        covered), then every object re-read against its checksum (empty: the step is sound)."""
        try:
            m = self.manifest(step)
        except CheckpointError as e:
            return [str(e)]
        missing = missing_units(m)
        problems = [f"step {step} is not whole: the manifest lacks {len(missing)} of the model's "
                    f"{len(expected_units(m))} units: {', '.join(missing)}"] if missing else []
        for name in sorted(m["units"]):
            try:
                self.read_unit(m, name)
            except CheckpointError as e:
                problems.append(str(e))
        return problems

    # -- delete -------------------------------------------------------------------
    def delete_step(self, step: int) -> int:
        """Delete a step's objects, the manifest first (so the step stops existing before its data goes)."""
        keys = [self.manifest_key(step)]
        prefix = self._key(step, "") + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if o["Key"] != keys[0]]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
        return len(keys)

    def keep_newest(self, keep: int) -> list[int]:
        """Keep the newest `keep` whole steps; delete older whole steps, every manifest that is not whole or not
        readable (it cannot be restored), and half-written steps older than the newest whole one (newer ones
        may be uploads in flight). A step that is not whole never counts toward `keep`."""
        infos = self.steps()
        whole, doomed = [], []
        for info in infos:  # newest first
            if not info.complete:
                continue
            try:
                self.whole_manifest(info.step)
            except CheckpointError as e:
                log.warning("deleting checkpoint step %d: %s", info.step, e)
                doomed.append(info.step)
                continue
            (whole if len(whole) < keep else doomed).append(info.step)
        if whole:
            doomed += [i.step for i in infos if not i.complete and i.step < whole[0]]
        for step in doomed:
            self.delete_step(step)
        return sorted(doomed)

    def newest_whole(self) -> tuple[int, dict] | None:
        """(newest whole, readable step, its manifest's meta: whose step it is); None when there is none."""
        for step in self.complete_steps():
            try:
                return step, self.whole_manifest(step).get("meta", {})
            except CheckpointError:
                continue
        return None


def expected_units(manifest: dict) -> dict[str, list[int]]:
    """The model's units ({name: full shape}) a manifest must cover: its own `model_units`, or for a format-2
    manifest the units of the model its meta records (its own units when it records none)."""
    if "model_units" in manifest:
        return manifest["model_units"]
    model = manifest.get("meta", {}).get("model")
    if not model:
        return {n: u["shape"] for n, u in manifest["units"].items()}
    from planner.specs import ModelSpec
    from workers.model import all_params

    return {p.name: list(p.shape) for p in all_params(ModelSpec(**model))}


def missing_units(manifest: dict) -> list[str]:
    """The model's units a manifest does not cover whole: absent, of another shape, or with pieces whose regions
    do not tile the full tensor (they must lie inside it, not overlap, and add up to it)."""
    out = []
    for name, shape in sorted(expected_units(manifest).items()):
        u = manifest["units"].get(name)
        if u is None or list(u["shape"]) != list(shape) or not _tiles([p["region"] for p in u["pieces"]], shape):
            out.append(name)
    return out


def _tiles(regions: list, shape: list[int]) -> bool:
    inside = all(len(r) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(r, shape, strict=True))
                 for r in regions)
    disjoint = all(any(b1 <= a2 or b2 <= a1 for (a1, b1), (a2, b2) in zip(r, q, strict=True))
                   for i, r in enumerate(regions) for q in regions[i + 1:])
    return inside and disjoint and sum(math.prod(b - a for a, b in r) for r in regions) == math.prod(shape)


def region_tag(region) -> str:
    """`((0, 64), (0, 32))` -> "0-64.0-32" (the object's name under its unit)."""
    return ".".join(f"{a}-{b}" for a, b in region) or "scalar"


def new_client(endpoint_url: str | None = None, config=None):
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
        raise ValueError(f"checkpoint.endpoint_url: cannot reach the S3 endpoint ({e}); check the URL and that "
                         "the service is up, or drop endpoint_url to use AWS") from None
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code"))
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise ValueError(f"checkpoint.uri: bucket {bucket!r} does not exist at "
                             f"{endpoint_url or 'AWS'}; create it (`aws s3 mb s3://{bucket}`) or fix the name") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ValueError(f"checkpoint.uri: access to bucket {bucket!r} was refused ({code}); check the "
                             "credentials and the bucket policy") from None
        raise ValueError(f"checkpoint.uri: the S3 endpoint answered {code} for bucket {bucket!r}") from None
    return S3Checkpoints(uri, endpoint_url)
