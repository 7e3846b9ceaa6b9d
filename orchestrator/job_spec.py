"""The job file (YAML): model, training, data, and for the embedded test cluster, `cluster:`.

Every section is a pydantic model with `extra="forbid"`, so a typo is an error
that names the field. `load_job` turns any problem into a ConfigError whose
message names the file, the field and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from orchestrator.errors import ConfigError
from planner.specs import PRESETS, ClusterSpec, ModelSpec, StrictModel, TrainSpec


class _Section(StrictModel):
    """Every section: unknown fields are errors, no inf/nan, no true/false where a number goes (planner/specs.py)."""


class ModelSection(_Section):
    """`preset:` picks a ModelSpec preset; any other field overrides it (or defines a custom model)."""

    preset: str | None = None
    init_from: str | None = None  # a Hugging Face directory: its config.json is the base, its weights the start
    name: str | None = None
    arch: Literal["gpt", "llama"] | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ffn_size: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None

    def resolve(self) -> ModelSpec:
        fields = self.model_dump(exclude_none=True, exclude={"preset"})
        if self.init_from is not None:
            from workers.hf_config import read_config, spec_fields

            if self.preset is not None:
                raise ValueError("give model.preset or model.init_from, not both (init_from reads its config.json)")
            path = str(Path(self.init_from).expanduser().resolve())
            base = {"name": Path(path).name} | spec_fields(read_config(path), f"model.init_from {self.init_from}")
            return ModelSpec(**(base | fields | {"init_from": path}))
        if self.preset is not None:
            if self.preset.lower() not in PRESETS:
                raise ValueError(f"unknown model preset {self.preset!r}; known presets: {', '.join(PRESETS)}")
            base = PRESETS[self.preset.lower()].model_dump()
            return ModelSpec(**(base | fields))
        return ModelSpec(**fields)


class DataSpec(_Section):
    kind: Literal["synthetic", "text", "tokens"] = Field(
        default="synthetic", description="synthetic: built-in learnable corpus; text: byte-level file; tokens: flat .bin"
    )
    path: str | None = Field(default=None, description="file for kind text or tokens")
    dtype: Literal["uint16", "uint32"] = Field(default="uint16", description="token file element type")

    @model_validator(mode="after")
    def _path_needed(self) -> DataSpec:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind {self.kind!r} needs data.path (the file to read)")
        return self


class RuntimeSpec(_Section):
    dtype: Literal["auto", "float32", "float64"] = Field(
        default="auto", description="auto: train.precision decides (bf16 or fp16 mixed precision, fp32, fp64); "
        "float32 or float64 force one dtype everywhere (float64 for exact equivalence checks)"
    )
    emulate_speed: bool = Field(
        default=True,
        description="on fake GPUs, slow each worker by the catalog TFLOPS ratio to the fastest type",
    )
    step_timeout_s: float = Field(default=120.0, gt=0, description="a step slower than this fails the job")
    collective_timeout_s: float = Field(default=60.0, gt=0, description="torch.distributed timeout")
    snapshot_every: int = Field(default=5, ge=1, description="copy every worker's state to a peer keeper every k "
                                "committed steps (checkpoint.peer_every overrides it)")
    scale_check_every: int = Field(default=10, ge=0, description="every k steps, look for nodes that joined and move "
                                   "onto a plan that uses them when that pays for the migration (0: never)")
    max_restarts: int = Field(default=100, ge=0, description="re-plans after failures before the job gives up (a "
                              "spot job sees many; a deterministic error stops it at once whatever this is)")
    profile: bool = Field(default=True, description="on a running cluster, measure each GPU type before planning "
                                                    "(skipped on fake GPUs)")
    tensorboard_dir: str | None = Field(default=None, description="write per-step scalars here (needs tensorboardX)")
    log_every: int = Field(default=10, ge=1, description="workers log a structured line every k steps")
    overlap_grad_sync: bool = Field(default=True, description="launch each layer's gradient all-reduce during the "
                                    "last micro-batch's backward (false: after backward; for comparison)")
    notices: Literal["none", "aws", "gcp", "azure"] = Field(
        default="none", description="poll each node's cloud metadata service for spot notices and drain before "
                                    "the deadline; Ray's own drain (`ray drain-node`, autoscaler) is heeded always")
    notice_poll_s: float = Field(default=1.0, gt=0, le=60, description="seconds between two polls of a node")
    meter_memory: bool = Field(default=False, description="count device-resident bytes per step against the GPU's "
                                                          "memory minus train.memory_reserve_gib (slows CPU steps)")


class CheckpointSpec(_Section):
    """Where and how often the job writes its state to S3 (any endpoint: AWS, MinIO, moto, ...)."""

    uri: str = Field(description="s3://BUCKET/PREFIX: one folder per job; steps go under it")
    endpoint_url: str | None = Field(default=None, description="S3 endpoint; default AWS_ENDPOINT_URL, else AWS")
    s3_every: int = Field(default=10, ge=1, description="upload the snapshot of every k-th committed step "
                                                          "(of those runtime.snapshot_every keeps)")
    keep: int = Field(default=3, ge=1, description="complete steps kept; older ones are deleted after a newer one exists")
    peer_every: int | None = Field(default=None, ge=1, description="copy every worker's state to a keeper on another "
                                   "node every k committed steps; default runtime.snapshot_every")
    restore_from: Literal["nearest", "s3"] = Field(default="nearest", description="nearest: survivors, then peer "
                                                   "memory, then S3; s3: S3 only (for comparison)")

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        from orchestrator.state.s3_store import parse_uri

        parse_uri(v)
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"endpoint_url {v!r} must be an http:// or https:// URL")
        return v


class JobSpec(_Section):
    name: str = "hetspot-job"
    model: ModelSection
    train: TrainSpec
    cluster: ClusterSpec | None = Field(default=None, description="the embedded test cluster's nodes")
    data: DataSpec = DataSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    checkpoint: CheckpointSpec | None = Field(default=None, description="S3 checkpoints; none: snapshots in memory only")
    steps: int = Field(default=10, ge=1)

    @property
    def model_spec(self) -> ModelSpec:
        return self.model.resolve()


def format_validation(path: str, err: ValidationError, what: str = "job file") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (a typo?); remove it or check the spelling against docs/jobfile.md"
        elif e["type"] == "missing":
            msg = "required field is missing; add it"
        lines.append(f"field '{loc}': {msg}")
    return f"{path}: invalid {what}. " + "; ".join(lines)


def parse_job(data: object, source: str = "<job>") -> JobSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a job file must be a YAML mapping with model:, train: and cluster: sections")
    try:
        job = JobSpec.model_validate(data)
        job.model_spec  # noqa: B018 - validates the model section (preset + overrides)
    except ValidationError as e:
        raise ConfigError(format_validation(source, e)) from None
    except ValueError as e:
        raise ConfigError(f"{source}: field 'model': {e}") from None
    return job


def load_job(path: str | Path) -> JobSpec:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"job file {str(p)!r} is a directory; pass the path of a YAML job file (see examples/)")
    if not p.is_file():
        raise ConfigError(f"job file {str(p)!r} does not exist; pass the path of a YAML job file (see examples/)")
    data = _read_yaml(p)
    if isinstance(data, dict) and isinstance(data.get("cluster"), str):
        data = data | {"cluster": _cluster_file(p, data["cluster"])}
    return parse_job(data, str(p))


def _read_yaml(p: Path, what: str = "job file", loader=yaml.SafeLoader):
    """A YAML file as data; any unreadable file is one ConfigError naming it (`loader`: a SafeLoader or subclass)."""
    try:
        return yaml.load(p.read_bytes().decode("utf-8"), Loader=loader)  # noqa: S506 - SafeLoader or a subclass
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); save the {what} as UTF-8 YAML") from None
    except RecursionError:
        raise ConfigError(f"{p}: YAML nested too deeply to read; a {what} is a few flat sections") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None


def _cluster_file(job_path: Path, ref: str) -> object:
    """`cluster: PATH`: a cluster spec file (with `nodes:`), relative to the job file, e.g. deploy/local/."""
    p = (job_path.parent / ref).resolve()
    if not p.is_file():
        raise ConfigError(f"{job_path}: field 'cluster': the cluster file {ref!r} ({p}) does not exist; give a path "
                          "relative to the job file, or list the nodes inline")
    return _read_yaml(p)


def require_cluster(job: JobSpec, source: str) -> ClusterSpec:
    if job.cluster is None:
        raise ConfigError(
            f"{source}: no 'cluster:' section; add one listing nodes (name, gpu_type, num_gpus), "
            "or pass --address to use a running Ray cluster"
        )
    return job.cluster
