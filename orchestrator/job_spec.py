"""The job file (YAML): model, training, data, and for the embedded test cluster, `cluster:`.

Every section is a pydantic model with `extra="forbid"`, so a typo is an error
that names the field. `load_job` turns any problem into a ConfigError whose
message names the file, the field and the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from orchestrator.errors import ConfigError
from planner.fleet import Catalog, Fleet
from planner.specs import PRESETS, ClusterSpec, ModelSpec, StrictModel, TrainSpec

if TYPE_CHECKING:
    from workers.transfer import CheckpointLocation


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


class ShardEntry(_Section):
    path: str
    bytes: int = Field(ge=0)
    version: str = Field(description="S3's ETag, or for a local file a SHA-256 of its size and its first and last "
                         "4 KiB (workers/corpus_index.py); empty: the size alone is checked")


class CorpusIndex(_Section):
    """The shards of data.path and data.val_path as the job found them at submit (workers/corpus_index.py)."""

    shards: list[ShardEntry]
    val_shards: list[ShardEntry] | None = None


class DataSpec(_Section):
    kind: Literal["synthetic", "text", "tokens"] = Field(
        default="synthetic",
        description="synthetic: built-in learnable corpus; text: byte-level file; tokens: flat .bin"
    )
    path: str | None = Field(default=None, description="file for kind text or tokens: a path on every node, or "
                             "s3://BUCKET/KEY (each worker reads the byte ranges of its samples); or a folder of "
                             "shards (a local folder, or s3://BUCKET/PREFIX/ ending in '/')")
    dtype: Literal["uint16", "uint32"] = Field(default="uint16", description="token file element type")
    endpoint_url: str | None = Field(default=None, description="S3 endpoint for an s3:// path; default "
                                     "AWS_ENDPOINT_URL, else AWS")
    cache_gb: float = Field(default=4.0, ge=0, description="s3:// data: the node's block cache on local disk, in GiB "
                            "(shared by its workers; least recently used blocks go); 0: no cache, one GET per sample")
    block_mib: float = Field(default=1.0, gt=0, le=1024, description="s3:// data: the size of a cached block in MiB "
                             "(one GET each); lower it for a corpus much larger than the cache, where each sample that "
                             "misses brings its whole block")
    cache_dir: str | None = Field(default=None, description="s3:// data: the cache folder on each node; default "
                                  "$HETSPOT_DATA_CACHE, else hetspot-data-cache in the system's temporary folder")
    val_fraction: float = Field(default=0.0, ge=0, lt=1, description="the share of the corpus's windows kept out of "
                                "training as the held-out set train.eval_every reads (its last windows)")
    val_path: str | None = Field(default=None, description="a held-out corpus of its own (a file, folder or s3:// "
                                 "prefix, like path): train.eval_every reads its windows in order")

    index: CorpusIndex | None = Field(default=None, description="written at submit, not by hand: the corpus's "
                                      "shards with their sizes and versions (S3 ETags); every worker opens exactly "
                                      "these and refuses one that changed. A job file that carries one pins its "
                                      "corpus: the submit refuses it if the shards differ")

    @model_validator(mode="after")
    def _path_needed(self) -> DataSpec:
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.kind {self.kind!r} needs data.path (the file to read)")
        return self


class TimeoutSpec(_Section):
    """How long the controller waits for each kind of call to its workers before it counts the call as a failure
    (a dead or hung rank) and recovers. The step's and torch.distributed's own are runtime.step_timeout_s and
    runtime.collective_timeout_s."""

    startup_s: float = Field(default=120.0, gt=0, description="placing a plan's workers, building their stages and "
                             "joining their process group")
    commit_s: float = Field(default=60.0, gt=0, description="every rank's update of a step (the optimizer step)")
    control_s: float = Field(default=60.0, gt=0, description="the state plane's short calls to workers: a snapshot "
                             "to a peer keeper, listing what ranks need and what kept processes hold, choosing "
                             "keepers, a keeper's receipt")
    hand_over_s: float = Field(default=30.0, gt=0, description="after a failure, survivors giving their committed "
                               "state to their node's keeper (restart recovery) or keeping it (in place); a rank "
                               "still silent after this is counted lost")
    transfer_s: float = Field(default=300.0, gt=0, description="moving one rank's state: a restore's pull from one "
                              "source and its load, a whole-state export or import; scale it with the model")


class RuntimeSpec(_Section):
    dtype: Literal["auto", "float32", "float64"] = Field(
        default="auto", description="auto: train.precision decides (bf16 or fp16 mixed precision, fp32, fp64); "
        "float32 or float64 force one dtype everywhere (float64 for exact equivalence checks)"
    )
    emulate_speed: bool | Literal["auto"] = Field(
        default="auto",
        description="auto or true: on fake GPUs (nodes labelled hetspot/fake-gpu=true, as test clusters are), slow "
        "each worker by the catalog TFLOPS ratio to the fastest type; real GPUs always run at their own speed (true "
        "says so in a warning where the plan has real GPUs); false: no emulation",
    )
    step_timeout_s: float = Field(default=120.0, gt=0, description="a step slower than this fails the job")
    collective_timeout_s: float = Field(default=60.0, gt=0, description="torch.distributed timeout")
    timeouts: TimeoutSpec = Field(default_factory=TimeoutSpec, description="how long the controller waits for each "
                                  "kind of call to its workers (runtime.timeouts.*)")
    snapshot_every: int = Field(default=5, ge=1, description="copy every worker's committed state to a keeper on "
                                "another node every k steps (the peer tier)")
    scale_check_every: int = Field(default=10, ge=0, description="every k steps, look for nodes that joined and move "
                                   "onto a plan that uses them when that pays for the migration (0: never)")
    recovery: Literal["in-place", "restart"] = Field(
        default="in-place", description="in-place: after a failure, a drain or a move, survivors keep their processes "
        "and the state they hold, re-form their groups under the new plan and receive only what they lack; restart: "
        "every worker process is replaced (survivors hand their state to their node's keeper first)")
    warm_workers: int = Field(
        default=0, ge=0, le=64, description="in-place recovery: keep up to this many worker processes ready on GPUs "
        "the plan leaves idle or that joined (torch imported, device context made, in no group), so a re-plan that "
        "needs a new rank takes one instead of starting a process. Each costs one Python process with torch in host "
        "memory, plus a CUDA context on a GPU (docs/recovery.md, in-place recovery). A notice pre-stages the next "
        "plan's new workers whatever this is; a node that joins gets workers on every GPU at once whatever this is")
    replan_tolerance: float = Field(
        default=0.02, ge=0.0, le=0.5, description="a re-plan after a loss or a notice may take a plan up to this "
        "share slower than the fastest candidate when its restore moves fewer bytes over the network (0.02: 2%; "
        "0: the plan that finishes soonest, migration included); the event says what was traded")
    max_restarts: int = Field(default=100, ge=0, description="re-plans after failures before the job gives up (a "
                              "spot job sees many; a deterministic error stops it at once whatever this is)")
    queue_timeout_s: float = Field(
        default=3600.0, gt=0, description="on a cluster other hetspot jobs share: how long the job waits in the "
        "cluster's queue (state `queued`, by priority, then first come first served) for GPUs they hold when no "
        "plan trains on what is free to it; past this it fails with exit code 2 naming the holders")
    priority: int = Field(
        default=0, ge=-1000, le=1000, description="on a cluster other hetspot jobs share: a waiting job of higher "
        "priority goes first in the queue and asks running jobs of lower priority to give back the GPUs it needs; "
        "each gives them back at a step boundary through the drain path (no step lost), or, where what it keeps "
        "would train no plan, is suspended (its committed step kept, in S3 where the run has a bucket) and waits in "
        "the queue to resume. Equal priorities never take GPUs from each other, unless both jobs share the fleet by "
        "weight (fleet_share)")
    fleet_share: Literal["first-come", "weighted"] = Field(
        default="first-come", description="on a cluster other hetspot jobs share: `first-come`, a waiting job gets "
        "what is free (and what priority takes); `weighted`, the cluster's nodes go to the jobs that share this "
        "way so as to maximise the sum of their tokens/s (each normalised to its rate on the whole cluster) "
        "weighted by 1 + priority, by the planner's estimates (after Gavel and Sia): a waiting job asks those "
        "jobs for the nodes that share gives it, and each gives back at a step boundary, in place, the asked "
        "nodes its own reading of the share does not keep (suspended where none would be left)")
    max_failures_without_progress: int = Field(
        default=5, ge=1, description="the job stops at this many failures in a row that lost no node with no step "
        "committed between them (a restore or a collective failing the same way on every new plan): re-planning "
        "does not get past those. A failure that takes a node (a spot loss) never counts")
    profile: bool = Field(default=True, description="on a running cluster, measure each GPU type before planning "
                                                    "(skipped on fake GPUs)")
    tensorboard_dir: str | None = Field(default=None, description="write per-step scalars here (needs tensorboardX); "
                                       "`record`: in the run record's location, so they outlive the head")
    log_every: int = Field(default=10, ge=1, description="workers log a structured line every k steps")
    torch_threads: int | Literal["auto"] = Field(
        default="auto", description="CPU threads each worker's torch uses (host-side work: the offloaded optimizer, "
        "data). auto: the node's CPUs per GPU on real GPU nodes (a g6.12xlarge: 48 / 4 = 12), 1 on fake-GPU test "
        "nodes, which share small machines")

    @field_validator("torch_threads")
    @classmethod
    def _threads(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}: use a number of threads >= 1, or auto")
        return v
    overlap_grad_sync: bool = Field(default=True, description="launch each layer's gradient all-reduce during the "
                                    "last micro-batch's backward (false: after backward; for comparison)")
    notices: Literal["none", "aws", "gcp", "azure"] = Field(
        default="none", description="poll each node's cloud metadata service for spot notices and drain before "
                                    "the deadline; Ray's own drain (`ray drain-node`, autoscaler) is heeded always")
    notice_poll_s: float = Field(default=1.0, gt=0, le=60, description="seconds between two polls of a node")
    notice_grace_s: float | None = Field(default=None, gt=0, le=600, description="seconds a GCP notice leaves "
                                         "(it carries no deadline): default a VM's 30 s; GKE spot pods get 15 s "
                                         "unless their node pool is configured for more")
    meter_memory: bool = Field(default=False, description="count device-resident bytes per step against the GPU's "
                                                          "memory minus train.memory_reserve_gib (slows CPU steps)")


class CheckpointSpec(_Section):
    """Where and how often the job writes its state to S3 (any endpoint: AWS, MinIO, moto, ...)."""

    uri: str = Field(description="s3://BUCKET/PREFIX: one folder per job; steps go under it")
    endpoint_url: str | None = Field(default=None, description="S3 endpoint; default AWS_ENDPOINT_URL, else AWS")
    s3_every: int = Field(default=50, ge=1, description="upload the committed state to S3 every k steps, from "
                          "the keepers (a multiple of runtime.snapshot_every: uploads come from the peer snapshots)")
    keep: int = Field(default=3, ge=1,
                      description="complete steps kept; older ones are deleted after a newer one exists")
    restore_from: Literal["nearest", "s3"] = Field(default="nearest", description="nearest: survivors, then peer "
                                                   "memory, then S3; s3: S3 only (for comparison)")
    resume: Literal["auto", "never"] = Field(default="auto", description="auto: a job run through Ray Jobs "
                                             "(--address) whose prefix holds this job's steps goes on from the newest "
                                             "complete one by itself (a restarted driver or head carries on); never: "
                                             "such a prefix is refused unless --resume is given. A local submit "
                                             "always asks for --resume")

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
            from workers.s3_data import redact

            raise ValueError(f"endpoint_url {redact(v)!r} must be an http:// or https:// URL")
        return v

    @property
    def location(self) -> CheckpointLocation:
        """The checkpoint location as one value, from here to the keeper that reads or writes the bytes."""
        from workers.transfer import CheckpointLocation  # the workers' transfer types: not for `hetspot plan`

        return CheckpointLocation(self.uri, self.endpoint_url)


class FleetType(_Section):
    """One GPU type the job may run on, in nodes of `gpus_per_node` GPUs (an autoscaler node type)."""

    gpu_type: str = Field(description="a catalog GPU type (planner/catalog.py), as Ray's accelerator_type names it")
    gpus_per_node: int = Field(default=1, ge=1, le=64, description="GPUs per node of this type")
    min_nodes: int = Field(default=0, ge=0, description="nodes of this type the job needs before it trains")
    max_nodes: int = Field(default=1, ge=1, description="nodes of this type hetspot asks the autoscaler for")
    market: Literal["spot", "on-demand"] = Field(default="spot", description="for people and the planner's prices")
    ray_resource: str | None = Field(default=None, description="the accelerator_type:<NAME> resource this type's "
                                     "nodes carry (default: Ray's own name for the GPU, e.g. A100, L4, T4; A100-40GB "
                                     "and A100-80GB share 'A100', so give each its own name on a fleet with both)")
    substitutes: list[str] = Field(default=[], description="types asked for instead, in this order, when this "
                                   "one stays short of max_nodes past fleet.substitute_after_s (a dry spot pool)")

    @field_validator("gpu_type")
    @classmethod
    def _known(cls, v: str) -> str:
        from planner.catalog import canonical_gpu_type

        return canonical_gpu_type(v)

    @model_validator(mode="after")
    def _range(self) -> FleetType:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"{self.gpu_type}: min_nodes {self.min_nodes} is above max_nodes {self.max_nodes}; "
                             "raise max_nodes or lower min_nodes")
        return self


class FleetAuto(_Section):
    """`fleet: {auto: ...}`: hetspot chooses the fleet from a catalog of instance types (planner/fleet.py) when
    the job starts, asks for it, and chooses again among what is left when a type does not come."""

    catalog: Catalog = Field(description="instance types with prices and preemption rates: a catalog file's path, "
                             "relative to the job file (examples/catalog-aws.yaml), or the catalog inline")
    objective: Literal["cost", "throughput"] = Field(default="cost", description="cost: least $ per million tokens "
                                                     "(risk-aware); throughput: most tokens/s within budget_per_hour")
    budget_per_hour: float | None = Field(default=None, gt=0, description="$/h the fleet may cost")

    @model_validator(mode="before")
    @classmethod
    def _one_type_per_gpu(cls, data):
        # The autoscaler's demand names a GPU type (the accelerator_type resource Ray sets), which does not tell
        # two instance types of one GPU apart: the fleet holds one instance type per GPU type.
        if isinstance(data, dict) and isinstance(data.get("catalog"), dict):
            data = data | {"catalog": data["catalog"] | {"one_per_gpu_type": True}}
        elif isinstance(data, dict) and isinstance(data.get("catalog"), Catalog):
            data = data | {"catalog": data["catalog"].model_copy(update={"one_per_gpu_type": True})}
        return data

    @model_validator(mode="after")
    def _budget(self) -> FleetAuto:
        if self.budget_per_hour is not None:
            cheapest = min(t.price_per_hour for t in self.catalog.types)
            if self.budget_per_hour < cheapest:
                raise ValueError(f"budget_per_hour {self.budget_per_hour:g} is below the cheapest fleet (one "
                                 f"instance, ${cheapest:g}/h); raise it")
        return self


class FleetSpec(_Section):
    """The GPUs hetspot asks Ray's autoscaler for (orchestrator/cluster/capacity.py): demand that stands while
    the job runs, so a preempted node is replaced, and is withdrawn when the job ends. Name the `types`, or
    let hetspot choose them (`auto`)."""

    types: list[FleetType] = Field(default=[], description="the GPU types the job may use")
    auto: FleetAuto | None = Field(default=None, description="choose the types from a catalog instead")
    wait_s: float = Field(default=900.0, gt=0, le=86400, description="fail (exit 2) when the types' min_nodes are "
                          "not up after this many seconds")
    substitute_after_s: float = Field(default=300.0, gt=0, description="a type short of max_nodes this long is "
                                      "asked for as its substitutes instead")
    poll_s: float = Field(default=2.0, gt=0, le=60, description="seconds between two looks at the cluster")

    @model_validator(mode="after")
    def _substitutes(self) -> FleetSpec:
        from planner.catalog import canonical_gpu_type

        if bool(self.types) == (self.auto is not None):
            raise ValueError("give fleet.types (the GPU types to ask for) or fleet.auto (choose them from a "
                             "catalog), one of the two")
        names = [t.gpu_type for t in self.types]
        if len(set(names)) != len(names):
            raise ValueError(f"types: {names} lists a GPU type twice; give each type once")
        graph: dict[str, list[str]] = {}
        for t in self.types:
            subs = [canonical_gpu_type(x) for x in t.substitutes]
            unknown = [x for x in subs if x not in names]
            if unknown:
                raise ValueError(f"{t.gpu_type}.substitutes: {unknown} are not fleet types; add them to "
                                 "fleet.types (with min_nodes 0) or remove them")
            if t.gpu_type in subs:
                raise ValueError(f"{t.gpu_type}.substitutes names the type itself; remove it")
            t.substitutes[:] = subs
            graph[t.gpu_type] = subs
        for start in graph:  # a type may not stand in, through others, for itself: a substitute cycle
            seen, todo = set(), list(graph[start])
            while todo:
                x = todo.pop()
                if x == start:
                    raise ValueError(f"substitutes form a cycle through {start}; a type may stand in for another, "
                                     "not back again: remove one direction")
                if x not in seen:
                    seen.add(x)
                    todo += graph[x]
        return self

    def chosen(self, catalog: Catalog, fleet: Fleet) -> FleetSpec:
        """This fleet asking for a fleet chosen from `catalog` (`fleet.auto`; orchestrator/control/fleet_choice.py
        calls it on the job's fleet, so that the control layer builds no job-file types itself)."""
        return self.model_copy(update={"types": fleet_types(catalog, fleet)})


def fleet_types(catalog: Catalog, fleet: Fleet) -> list[FleetType]:
    """A chosen fleet as the fleet types the capacity loop asks for: all of each type's nodes are needed."""
    return [FleetType(gpu_type=catalog.type(name).gpu_type, gpus_per_node=catalog.type(name).num_gpus,
                      min_nodes=n, max_nodes=n, market=catalog.type(name).market) for name, n in fleet]


class JobSpec(_Section):
    name: str = "hetspot-job"
    model: ModelSection
    train: TrainSpec
    cluster: ClusterSpec | None = Field(default=None, description="the embedded test cluster's nodes")
    data: DataSpec = DataSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    checkpoint: CheckpointSpec | None = Field(default=None,
                                              description="S3 checkpoints; none: snapshots in memory only")
    fleet: FleetSpec | None = Field(default=None, description="GPUs to ask Ray's autoscaler for (--address jobs)")
    steps: int = Field(default=10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data):
        """Spellings of the previous release, accepted for this one (`parse_job` warns, naming the file)."""
        ckpt = data.get("checkpoint") if isinstance(data, dict) else None
        if isinstance(ckpt, dict) and "peer_every" in ckpt:
            runtime = data.get("runtime") if isinstance(data.get("runtime"), dict) else {}
            every = ckpt["peer_every"]
            if "snapshot_every" in runtime and runtime["snapshot_every"] != every:
                raise ValueError("checkpoint.peer_every is the old name of runtime.snapshot_every, and the two differ; "
                                 "keep runtime.snapshot_every only")
            data = data | {"checkpoint": {k: v for k, v in ckpt.items() if k != "peer_every"},
                           "runtime": runtime | {"snapshot_every": every}}
        return data

    @model_validator(mode="after")
    def _s3_on_snapshots(self) -> JobSpec:
        c, every = self.checkpoint, self.runtime.snapshot_every
        if c is not None and c.s3_every % every:
            raise ValueError(f"checkpoint.s3_every ({c.s3_every}) counts steps and must be a multiple of "
                             f"runtime.snapshot_every ({every}): uploads come from the peer snapshots; use "
                             f"{max(every, c.s3_every // every * every)} or change snapshot_every")
        return self

    @property
    def model_spec(self) -> ModelSpec:
        return self.model.resolve()

    def demand(self) -> FleetSpec | None:
        """What the job asks a real cluster's autoscaler for: its `fleet:`, else exactly its `cluster:` nodes
        (each GPU type's count, all of them needed before it trains), else nothing."""
        if self.fleet is not None or self.cluster is None:
            return self.fleet
        by_type: dict[str, list[int]] = {}
        for n in self.cluster.nodes:
            by_type.setdefault(n.gpu_type, []).append(n.num_gpus)
        return FleetSpec(types=[FleetType(gpu_type=t, gpus_per_node=max(g), min_nodes=len(g), max_nodes=len(g),
                                          market="spot" if any(n.market == "spot" for n in self.cluster.nodes
                                                               if n.gpu_type == t) else "on-demand")
                                for t, g in sorted(by_type.items())])


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
    ckpt = data.get("checkpoint")
    if isinstance(ckpt, dict) and "peer_every" in ckpt:  # the previous release's spelling: one line, this file
        warnings.warn(f"{source}: checkpoint.peer_every is now runtime.snapshot_every; write `runtime: "
                      f"{{snapshot_every: {ckpt['peer_every']}}}` (the old name goes in the next release)",
                      FutureWarning, stacklevel=2)
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
    auto = data.get("fleet", {}).get("auto") if isinstance(data, dict) and isinstance(data.get("fleet"), dict) else None
    if isinstance(auto, dict) and isinstance(auto.get("catalog"), str):
        catalog = _side_file(p, auto["catalog"], "fleet.auto.catalog", "catalog")
        data = data | {"fleet": data["fleet"] | {"auto": auto | {"catalog": catalog}}}
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
    return _side_file(job_path, ref, "cluster", "cluster", "list the nodes inline")


def _side_file(job_path: Path, ref: str, field: str, what: str, inline: str = "give it inline") -> object:
    """A file a job file names by path (`cluster: PATH`, `fleet.auto.catalog: PATH`), relative to the job file."""
    p = (job_path.parent / ref).resolve()
    if not p.is_file():
        raise ConfigError(f"{job_path}: field '{field}': the {what} file {ref!r} ({p}) does not exist; give a path "
                          f"relative to the job file, or {inline}")
    return _read_yaml(p, f"{what} file")


def fleet_cluster(job: JobSpec) -> ClusterSpec | None:
    """The cluster a job's `fleet:` types come to at their most nodes (what `hetspot plan` plans on for a job
    that asks a cloud for its GPUs); None without fleet types."""
    from planner.specs import NodeSpec

    if job.fleet is None or not job.fleet.types:
        return None
    return ClusterSpec(nodes=[NodeSpec(name=f"{t.gpu_type.lower()}-{i}", gpu_type=t.gpu_type, num_gpus=t.gpus_per_node,
                                       market=t.market) for t in job.fleet.types for i in range(t.max_nodes)])


def require_cluster(job: JobSpec, source: str) -> ClusterSpec:
    if job.cluster is None:
        raise ConfigError(
            f"{source}: no 'cluster:' section; add one listing nodes (name, gpu_type, num_gpus), "
            "or pass --address to use a running Ray cluster"
        )
    return job.cluster
