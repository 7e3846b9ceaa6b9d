"""The S3 tier's manifest as plain data: its format, and what makes a step whole, readable and this run's.

A step folder `PREFIX/step-0000000041/` holds one object per unit slice and `manifest.json`, written last and
once. Format 4 names each piece relative to its folder (`units/<unit>/<region>.run-<run id>.safetensors`), so a
copied or moved prefix reads its own objects and never the original's; formats 2 and 3 named absolute keys,
and their pieces are found the same way, by the part of the key after `step-N/`. A manifest whose `step` is
not its folder's (a step folder copied or renamed to another number) is refused. A format-4 piece also records
the tensors it holds and their dtypes, so a reader checks content (names, shapes against the region, dtypes,
the optimizer's moments after its first update), not only bytes.

Who wrote a step (`Identity`): the job, the run (`meta.run_id`, one lineage: `--resume` keeps it) and the
model's unit list. A run counts, overwrites, loads and deletes only its own steps; the piece names carry the
run too, so two writers of one step number never share an object.

No boto3 and no torch: s3_store.py does the I/O, this module decides. Each refusal is a `CheckpointError` whose
`refusal` (orchestrator/errors.py `Refusal`) says whether the step is broken (a redo may replace it) or only
unreadable this time (never deleted for it).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NoReturn

from orchestrator.errors import CheckpointError, Refusal

FORMAT = "hetspot-checkpoint/4"
READ_FORMATS = ("hetspot-checkpoint/2", "hetspot-checkpoint/3", FORMAT)
KEYS = ("param", "exp_avg", "exp_avg_sq")  # a piece's tensors: the weights and AdamW's moments
MOMENTS = KEYS[1:]
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"(?:^|/)step-(\d{10})/")
_PIECE = re.compile(r"(?P<region>[^/]+?)(?:\.run-(?P<run>[A-Za-z0-9_-]+))?\.safetensors")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 100,000 pieces is about 30 MB; anything larger is not one
MAX_META_DEPTH = 16  # `meta` is free-form: nested deeper than this it is not hetspot's
MAX_TILING_CELLS = 1 << 22  # the tiling check's grid: a real layout's pieces make as many cells as pieces
SAFETENSORS_HEADER_MAX = 1 << 20  # a piece's header lists at most three tensors: far under this
# Bytes per element of each dtype a piece may hold (a piece's size follows from its region and its tensors).
ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}


def step_dir(prefix: str, step: int) -> str:
    """The folder of `step` under `prefix` ("" for the bucket's root), with its trailing slash."""
    return f"{prefix}/step-{step:010d}/" if prefix else f"step-{step:010d}/"


def region_tag(region: Iterable[tuple[int, int]]) -> str:
    """`((0, 64), (0, 32))` -> "0-64.0-32" (the object's name under its unit)."""
    return ".".join(f"{a}-{b}" for a, b in region) or "scalar"


def piece_key(folder: str, unit: str, region: Iterable[tuple[int, int]], run_id: str | None = None) -> str:
    """The key of one piece of `unit` over `region` in a step folder; the run's id is part of its name."""
    run = f".run-{run_id}" if run_id else ""
    return f"{folder}units/{unit}/{region_tag(region)}{run}.safetensors"


def piece_run(key: str) -> str | None:
    """The run that wrote a piece, from its name (None: an older format's piece, or not a piece)."""
    m = _PIECE.fullmatch(key.rsplit("/", 1)[-1])
    return m.group("run") if m else None


def units_digest(model_units: dict[str, list[int]]) -> str:
    """A short fingerprint of a model's unit list (names and full shapes)."""
    rows = sorted((n, [int(x) for x in s]) for n, s in model_units.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Identity:
    """Whose a step is. A field that is None matches anything: `Identity(job, None, units)` is every run of the
    job on that model (what `--resume` chooses among); a manifest that records no job or run (an older format)
    is counted as the reader's own, as before."""

    job: str | None
    run_id: str | None
    units: str | None  # units_digest of the model's unit list

    @classmethod
    def of(cls, meta: dict, model_units: dict[str, list[int]] | None) -> Identity:
        return cls(meta.get("job"), meta.get("run_id"), units_digest(model_units) if model_units else None)

    def foreign(self, other: Identity) -> str | None:
        """Why a step written by `other` is not this identity's (None: it is)."""
        if self.job is not None and other.job not in (None, self.job):
            return f"written by job {other.job!r}, not {self.job!r}"
        if self.units is not None and other.units not in (None, self.units):
            return "written for another model (its unit list differs)"
        if self.run_id is not None and other.run_id not in (None, self.run_id):
            return f"written by run {other.run_id} of job {other.job!r}, not this run ({self.run_id})"
        return None


def manifest_identity(manifest: dict) -> Identity:
    return Identity.of(manifest.get("meta", {}), expected_units(manifest))


# -- reading a manifest -----------------------------------------------------------------------------------------
def parse_manifest(raw: bytes, step: int, folder: str, where: str,
                   derive_units: Callable[[dict], dict[str, list[int]]] | None = None) -> dict:
    """A stored manifest, checked field by field, with every piece's key resolved to an absolute key in `folder`
    (the folder it was read from) and the step's `optimizer_steps` on each piece (its content check needs it).
    `derive_units` gives a format-2 manifest's unit list from its `meta.model`. CheckpointError (MALFORMED, or
    CORRUPT for a piece that says it lacks the optimizer's moments) names the field."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where} is not a readable manifest (it is over {MAX_MANIFEST_BYTES:,} bytes, the "
                              "most a manifest may be)", Refusal.MALFORMED, step)
    try:
        m = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise CheckpointError(f"{where} is not a readable manifest (its JSON is nested too deep to be one)",
                              Refusal.MALFORMED, step) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not valid JSON (truncated?): {getattr(e, 'msg', e)}", Refusal.MALFORMED,
                              step) from None
    problem = _field_problem(m)
    if problem:
        raise CheckpointError(f"{where} is not a readable manifest ({problem})", Refusal.MALFORMED, step)
    if m["step"] != step:
        raise CheckpointError(f"{where} says step {m['step']}, not {step}: a step folder copied or renamed to "
                              "another number is refused", Refusal.MALFORMED, step)
    m.setdefault("meta", {})
    if "model_units" not in m:
        m["model_units"] = _derived_units(m, derive_units, where, step)
    fmt = m["format"]
    for unit, u in m["units"].items():
        for i, piece in enumerate(u["pieces"]):
            rel = piece["key"] if fmt == FORMAT else _after_step_dir(piece["key"])
            if rel is None or not _relative(rel):
                raise CheckpointError(f"{where} is not a readable manifest (units[{unit!r}].pieces[{i}].key "
                                      f"{piece['key']!r} is not a path inside its step folder)", Refusal.MALFORMED,
                                      step)
            piece["key"] = folder + rel
            piece["optimizer_steps"] = float(m["optimizer_steps"])
            size = _size_problem(piece)
            if size:
                raise CheckpointError(f"{where}: piece {piece['key']} of {unit} is not what it says: {size}",
                                      Refusal.CORRUPT, step)
            declared = piece.get("tensors")
            if declared is not None and m["optimizer_steps"] > 0 and not set(MOMENTS) <= set(declared):
                raise CheckpointError(f"{where}: piece {piece['key']} of {unit} lacks the optimizer's moments "
                                      f"({', '.join(MOMENTS)}) after {m['optimizer_steps']:g} updates",
                                      Refusal.CORRUPT, step)
    return m


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a number a manifest may hold")


def _depth(obj: Any, limit: int) -> int:
    """How deep `obj` nests (iteratively, stopping past `limit`)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack += [(v, d + 1) for v in (x.values() if isinstance(x, dict) else x)]
    return deepest


def _derived_units(m: dict, derive_units: Callable[[dict], dict[str, list[int]]] | None, where: str,
                   step: int) -> dict[str, list[int]]:
    model = m["meta"].get("model")
    if not model or derive_units is None:
        return {n: list(u["shape"]) for n, u in m["units"].items()}
    try:
        return derive_units(model)
    except Exception as e:  # noqa: BLE001 - a model record this hetspot cannot read: that manifest only is refused
        raise CheckpointError(f"{where} is not a readable manifest (meta.model does not describe a model this "
                              f"hetspot knows: {type(e).__name__}: {str(e).splitlines()[0][:200]})",
                              Refusal.MALFORMED, step) from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shape_ok(shape: Any) -> bool:
    return isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)


def _field_problem(m: Any) -> str | None:
    """The first field of a manifest that is not what the format says, as "field: what is wrong"; None if sound."""
    if not isinstance(m, dict):
        return "not a JSON object"
    if m.get("format") not in READ_FORMATS:
        return f"format {m.get('format')!r} is not one of {', '.join(READ_FORMATS)}"
    if not _is_int(m.get("step")):
        return "step: not an integer"
    if not isinstance(m.get("optimizer_steps"), (int, float)) or isinstance(m["optimizer_steps"], bool) \
            or not math.isfinite(m["optimizer_steps"]) or m["optimizer_steps"] < 0:
        return "optimizer_steps: not a finite number >= 0"
    if not isinstance(m.get("meta", {}), dict):
        return "meta: not an object"
    if _depth(m.get("meta", {}), MAX_META_DEPTH) > MAX_META_DEPTH:
        return f"meta: nested deeper than {MAX_META_DEPTH} levels"
    units = m.get("model_units")
    if units is not None and not (isinstance(units, dict) and all(_shape_ok(s) for s in units.values())):
        return "model_units: not {unit: [dims]}"
    if m["format"] != READ_FORMATS[0] and units is None:
        return "model_units: missing"
    if not isinstance(m.get("units"), dict):
        return "units: not an object"
    for name, u in m["units"].items():
        if not isinstance(u, dict) or not _shape_ok(u.get("shape")):
            return f"units[{name!r}].shape: not a list of dimensions"
        pieces = u.get("pieces")
        if not isinstance(pieces, list) or not pieces:
            return f"units[{name!r}].pieces: not a non-empty list"
        for i, p in enumerate(pieces):
            problem = _piece_problem(p, len(u["shape"]), m["format"] == FORMAT)
            if problem:
                return f"units[{name!r}].pieces[{i}].{problem}"
    return None


def _piece_problem(p: Any, ndim: int, declares_tensors: bool) -> str | None:
    if not isinstance(p, dict):
        return "(piece): not an object"
    if not isinstance(p.get("key"), str) or not p["key"]:
        return "key: not a string"
    region = p.get("region")
    if not (isinstance(region, list) and len(region) == ndim and all(
            isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) for r in region)):
        return f"region: not {ndim} [start, stop] pairs"
    if not isinstance(p.get("sha256"), str) or not _SHA256.fullmatch(p["sha256"]):
        return "sha256: not 64 hex digits"
    if not _is_int(p.get("bytes")) or p["bytes"] < 0:
        return "bytes: not a size"
    if "version" in p and not (isinstance(p["version"], str) and 0 < len(p["version"]) <= 1024):
        return "version: not an object version id"
    if "etag" in p and not (isinstance(p["etag"], str) and 0 < len(p["etag"]) <= 256):
        return "etag: not an ETag"
    tensors = p.get("tensors")
    if declares_tensors or tensors is not None:
        if not (isinstance(tensors, dict) and "param" in tensors and set(tensors) <= set(KEYS)
                and all(d in ITEMSIZE for d in tensors.values())):
            return f"tensors: not {{name: dtype}} of {', '.join(KEYS)} with param, dtypes of {', '.join(ITEMSIZE)}"
    return None


def _size_problem(p: dict) -> str | None:
    """A piece whose size cannot be its region's tensors: its size follows from its region and dtypes, so what a
    reader allocates for a step is bounded by bytes the bucket really holds (its listing shows them)."""
    numel = math.prod(b - a for a, b in p["region"])
    tensors = p.get("tensors")
    if tensors is not None:
        least = most = numel * sum(ITEMSIZE[d] for d in tensors.values())
    else:  # an older format: the weights and up to two moments, in 16 to 64 bits
        least, most = numel * 2, numel * max(ITEMSIZE.values()) * len(KEYS)
    if least <= p["bytes"] - 8 <= most + SAFETENSORS_HEADER_MAX:
        return None
    return (f"its {p['bytes']} bytes cannot hold the region {p['region']} ({numel} elements) of "
            f"{', '.join(sorted(tensors)) if tensors else 'its tensors'}")


def _after_step_dir(key: str) -> str | None:
    """An older format's absolute key, as a path inside its step folder ("units/..."); None if it has none."""
    found = list(_STEP_DIR.finditer(key))
    return key[found[-1].end():] if found else None


def _relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def stored(manifest: dict, folder: str) -> dict:
    """A manifest built in memory (absolute keys) as it is written: format 4, keys relative to `folder`."""
    out = dict(manifest, units={})
    for name, u in manifest["units"].items():
        pieces = []
        for p in u["pieces"]:
            if not p["key"].startswith(folder):
                raise CheckpointError(f"piece {p['key']} of {name} is not in the step's folder {folder}")
            pieces.append({k: v for k, v in p.items() if k != "optimizer_steps"} | {"key": p["key"][len(folder):]})
        out["units"][name] = dict(u, pieces=pieces)
    return out


def same_write(a: dict, b: dict) -> bool:
    """Two manifests of one step that record the same write: one run, the same pieces and bytes."""
    def pieces(m: dict) -> dict:
        return {p["key"]: (p["sha256"], p["bytes"]) for u in m["units"].values() for p in u["pieces"]}
    return (a.get("meta", {}).get("run_id") == b.get("meta", {}).get("run_id")
            and float(a["optimizer_steps"]) == float(b["optimizer_steps"]) and pieces(a) == pieces(b))


# -- whole, readable, sound -------------------------------------------------------------------------------------
def expected_units(manifest: dict) -> dict[str, list[int]]:
    """The model's units ({name: full shape}) a manifest must cover (parse_manifest fills it for format 2)."""
    if "model_units" in manifest:
        return manifest["model_units"]
    return {n: u["shape"] for n, u in manifest["units"].items()}


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
    """The regions lie inside `shape`, do not overlap and cover it. On the grid of every region's cut points
    (per dimension), each region is a box of cells, and they tile when every cell is covered once: as many cells
    as pieces for a real layout (TP slices, or a mix of two TP degrees' slices), so the check is linear in the
    pieces; a grid over MAX_TILING_CELLS cells is refused, not searched."""
    if not all(len(r) == len(shape) and all(0 <= a < b <= n for (a, b), n in zip(r, shape, strict=True))
               for r in regions):
        return False
    if sum(math.prod(b - a for a, b in r) for r in regions) != math.prod(shape):
        return False
    cuts = [sorted({0, n} | {x for r in regions for x in r[d]}) for d, n in enumerate(shape)]
    at = [{x: i for i, x in enumerate(c)} for c in cuts]
    sizes = [len(c) - 1 for c in cuts]
    if math.prod(sizes) > MAX_TILING_CELLS:
        return False
    seen: set[tuple[int, ...]] = set()
    for r in regions:
        spans = [range(at[d][a], at[d][b]) for d, (a, b) in enumerate(r)]
        if math.prod(len(s) for s in spans) > MAX_TILING_CELLS - len(seen):
            return False
        for cell in itertools.product(*spans):
            if cell in seen:
                return False
            seen.add(cell)
    return len(seen) == math.prod(sizes)


def unlisted(manifest: dict, listing: dict[str, int]) -> list[str]:
    """The pieces of a manifest that a listing of its folder ({key: size}) does not show at their size: gone (a
    lifecycle rule, a hand delete) or replaced. S3's listings are strongly consistent, so a listed object of the
    right size, and of the ETag S3 answered its PUT (where the manifest records one; a versioned piece is read
    as its recorded version, whatever is current), can be read: this is the readability proof pruning and the
    resume choice use (one LIST for the whole prefix instead of a HEAD per piece); the checksums are checked
    when the bytes are read."""
    etags = getattr(listing, "etags", {})
    out = []
    for u in manifest["units"].values():
        for p in u["pieces"]:
            size = listing.get(p["key"])
            if size is None:
                out.append(f"{p['key']} (not in the bucket)")
            elif size != p["bytes"]:
                out.append(f"{p['key']} ({size} bytes, not {p['bytes']})")
            elif p.get("etag") and etags.get(p["key"]) and etags[p["key"]] != p["etag"] and not p.get("version"):
                out.append(f"{p['key']} (replaced since it was written: its ETag is {etags[p['key']]}, not "
                           f"{p['etag']})")
    return out


def piece_problems(entry: dict, found: dict[str, tuple[str, tuple[int, ...]]]) -> list[str]:
    """What is wrong with a piece's tensors ({name: (dtype, shape)}) against its manifest entry: names (the
    format-4 `tensors` record, the weights always, the moments after the optimizer's first update), each shape
    against the region (a smaller tensor would be broadcast on load), dtypes against the record."""
    region = [b - a for a, b in entry["region"]]
    names = set(found)
    declared = entry.get("tensors")
    problems = []
    if "param" not in names:
        problems.append("it has no 'param' tensor")
    if names - set(KEYS):
        problems.append(f"it holds tensors no piece has ({', '.join(sorted(names - set(KEYS)))})")
    if declared is not None and names != set(declared):
        problems.append(f"it holds {', '.join(sorted(names))}; the manifest says {', '.join(sorted(declared))}")
    if (entry.get("optimizer_steps") or 0) > 0 and not set(MOMENTS) <= names:
        problems.append(f"it lacks the optimizer's moments ({', '.join(m for m in MOMENTS if m not in names)}) "
                        f"after {entry['optimizer_steps']:g} updates")
    for name, (dtype, shape) in sorted(found.items()):
        if list(shape) != region:
            problems.append(f"{name} is {list(shape)}, its region {entry['region']} is {region}")
        if declared is not None and name in declared and declared[name] != dtype:
            problems.append(f"{name} is {dtype}, the manifest says {declared[name]}")
    return problems
