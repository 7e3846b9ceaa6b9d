"""User-facing specs for the planner: the cluster, the model and the training run.

All are pydantic models with `extra="forbid"` so a typo in a job file is an error
rather than a silent default. They round-trip through JSON and YAML.
Devices are named `"<node>/<gpu index>"` everywhere (see `device_id`).
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from planner.catalog import canonical_gpu_type, gpu_info


class StrictModel(BaseModel):
    """Specs and job-file sections: unknown fields are errors, floats are finite, numbers are not booleans."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, v: Any, info: Any) -> Any:
        """YAML's true/false is not a count or a size (pydantic would read true as 1)."""
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            if ann in (int, float) or set(get_args(ann)) & {int, float}:
                raise ValueError(f"must be a number, not {str(v).lower()}")
        return v


def device_id(node: str, index: int) -> str:
    return f"{node}/{index}"


def plain_name(v: str, what: str) -> str:
    """A name that becomes part of device ids and Ray labels: non-empty, no '/', no spaces at the ends."""
    if not v or "/" in v or v.strip() != v:
        raise ValueError(f"{what} {v!r} must be non-empty, without '/' or spaces at the ends")
    return v


@functools.lru_cache(maxsize=65536)
def _device_ids(node: str, num_gpus: int) -> tuple[str, ...]:
    return tuple(device_id(node, i) for i in range(num_gpus))  # a re-plan at 16k GPUs asks 16k times


class NodeSpec(StrictModel):
    name: str = Field(description="unique node name; also the Ray node label hetspot/node")
    gpu_type: str = Field(description="catalog GPU type, e.g. A100-80GB, L4, T4")
    num_gpus: int = Field(ge=1, le=64, description="GPUs on this node, all of gpu_type")
    market: Literal["spot", "on-demand"] = "spot"
    price_per_hour: float | None = Field(default=None, ge=0, description="node $/h, if known")
    preemptions_per_hour: float = Field(default=0.0, ge=0, le=60, description="expected preemptions of this node "
                                        "per hour (from a spot trace or the provider's advisor); the cost "
                                        "objective charges each one's recovery")
    zone: str = ""
    intra_node_bw_gb_s: float | None = Field(
        default=None, gt=0, description="GPU-GPU bandwidth on the node; default from the catalog"
    )
    inter_node_bw_gb_s: float = Field(
        default=12.5, gt=0, description="node network bandwidth, GB/s (12.5 = 100 Gbit/s)"
    )
    host_mem_gib: float | None = Field(
        default=None, gt=0, le=65536, description="host RAM of the node for offloaded state, shared by its GPUs' "
        "workers; default per GPU type (planner/catalog.py HOST_MEM_GIB_PER_GPU) times num_gpus"
    )
    cpu_adam_params_per_s: float = Field(
        default=1.0e9, gt=0, description="host AdamW throughput for offloaded optimizer state"
    )
    instance_type: str | None = None
    instance_id: str | None = None

    @field_validator("gpu_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        return canonical_gpu_type(v)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        return plain_name(v, "node name")

    @property
    def host_mem(self) -> float:
        """Host RAM in GiB: as given, else the catalog's default for the GPU type."""
        from planner.catalog import default_host_mem_gib

        if self.host_mem_gib is not None:
            return self.host_mem_gib
        return default_host_mem_gib(self.gpu_type, self.num_gpus)

    @property
    def intra_bw_gb_s(self) -> float:
        return self.intra_node_bw_gb_s or gpu_info(self.gpu_type).intra_node_bw_gb_s

    def device_ids(self) -> list[str]:
        return list(_device_ids(self.name, self.num_gpus))


class ClusterSpec(StrictModel):
    nodes: list[NodeSpec] = Field(min_length=1)
    calibration: dict[str, float] = Field(
        default_factory=dict,
        description="measured efficiency (fraction of peak) per GPU type; overrides the catalog",
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        seen: set[str] = set()
        for n in self.nodes:
            if n.name in seen:
                raise ValueError(f"duplicate node name {n.name!r}; node names must be unique")
            seen.add(n.name)
        for t, eff in self.calibration.items():
            canonical_gpu_type(t)
            if not 0 < eff <= 1:
                raise ValueError(f"calibration[{t!r}]={eff} must be in (0, 1]")
        return self

    def node(self, name: str) -> NodeSpec:
        return self._by_name("_index", lambda n: n)[name]

    def nics(self) -> dict[str, float]:
        """Each node's NIC bandwidth (GB/s), by name (cached, like `node`)."""
        return self._by_name("_nics", lambda n: n.inter_node_bw_gb_s)

    def _by_name(self, slot: str, value: Any) -> dict:
        """{node name: value(node)}, built once per node list (a frozen model: cached in its __dict__, with the
        list it was built from, since `model_copy` carries the cache into a copy with other nodes)."""
        got = self.__dict__.get(slot)
        if got is None or got[0] is not self.nodes:
            got = (self.nodes, {n.name: value(n) for n in self.nodes})
            object.__setattr__(self, slot, got)
        return got[1]

    def efficiency(self, gpu_type: str) -> float:
        for t, eff in self.calibration.items():
            if canonical_gpu_type(t) == gpu_type:
                return eff
        return gpu_info(gpu_type).default_efficiency

    @property
    def num_gpus(self) -> int:
        return sum(n.num_gpus for n in self.nodes)

    def without_nodes(self, names: set[str]) -> ClusterSpec:
        return self.model_copy(update={"nodes": [n for n in self.nodes if n.name not in names]})


class ModelSpec(StrictModel):
    """A pre-norm decoder with an untied head, of one of two architectures:

    - "gpt" (nanoGPT): LayerNorm with biases, GELU MLP (default width 4h), learned positions;
    - "llama": RMSNorm, SwiGLU MLP (three matrices; default width 8h/3 rounded up to 256),
      rotary positions, grouped-query attention (`num_kv_heads`), no biases.
    """

    name: str = "custom"
    arch: Literal["gpt", "llama"] = "gpt"
    num_layers: int = Field(ge=1, le=1024)
    hidden_size: int = Field(ge=8, le=65536)
    num_heads: int = Field(ge=1, le=1024)
    num_kv_heads: int | None = Field(default=None, ge=1, description="llama: key/value heads (GQA); default num_heads")
    ffn_size: int | None = Field(default=None, ge=1, le=2**20,
                                 description="MLP width; default 4h (gpt) or 8h/3 to 256 (llama)")
    vocab_size: int = Field(ge=2, le=2**22)
    seq_len: int = Field(ge=2, le=2**20)
    rope_theta: float = Field(default=10000.0, gt=0, description="llama: RoPE base")
    norm_eps: float = Field(default=1e-5, gt=0, description="llama: RMSNorm epsilon")
    init_from: str | None = Field(default=None, description="a Hugging Face directory whose weights start the run")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}"
            )
        if self.num_kv_heads is not None and self.arch != "llama":
            raise ValueError("num_kv_heads is a llama field; set arch: llama or remove it")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.kv_heads}")
        return self

    @cached_property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @cached_property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @cached_property
    def ffn(self) -> int:
        if self.ffn_size:
            return self.ffn_size
        return 4 * self.hidden_size if self.arch == "gpt" else -(-8 * self.hidden_size // 3 // 256) * 256

    @cached_property
    def matmul_params(self) -> int:
        """Weights of one block's matrices (what a token's forward multiplies by, 2 FLOPs each)."""
        h, f = self.hidden_size, self.ffn
        if self.arch == "llama":
            return 2 * h * h + 2 * h * self.kv_heads * self.head_dim + 3 * h * f
        return 4 * h * h + 2 * h * f

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one block: its matrices, plus (gpt) biases and two LayerNorms, (llama) two RMSNorms."""
        h, f = self.hidden_size, self.ffn
        if self.arch == "llama":
            return self.matmul_params + 2 * h
        return self.matmul_params + 4 * h + f + h + 4 * h

    @cached_property
    def embed_params(self) -> int:
        return (self.vocab_size + (self.seq_len if self.arch == "gpt" else 0)) * self.hidden_size

    @cached_property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size + (2 if self.arch == "gpt" else 1) * self.hidden_size

    @cached_property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + self.embed_params + self.head_params

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        key = name.lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        return PRESETS[key]


def _p(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int, ffn: int | None = None,
       **llama: Any) -> ModelSpec:
    return ModelSpec(
        name=name, num_layers=layers, hidden_size=hidden, num_heads=heads,
        ffn_size=ffn, vocab_size=vocab, seq_len=seq, **({"arch": "llama"} | llama if llama else {}),
    )


PRESETS: dict[str, ModelSpec] = {
    "tiny": _p("tiny", 4, 32, 4, 64, 16),  # CPU tests: ~55k params
    "small": _p("small", 6, 128, 4, 256, 64),  # CPU demo: ~1.2M params
    "gpt-125m": _p("gpt-125m", 12, 768, 12, 50304, 1024),
    "gpt-350m": _p("gpt-350m", 24, 1024, 16, 50304, 1024),
    "gpt-1.3b": _p("gpt-1.3b", 24, 2048, 16, 50304, 2048),
    "7b": _p("7b", 32, 4096, 32, 32000, 2048),
    "13b": _p("13b", 40, 5120, 40, 32000, 2048),
    "30b": _p("30b", 60, 6656, 52, 32000, 2048),
    "70b": _p("70b", 80, 8192, 64, 32000, 2048, ffn=36864),  # 4.5h GELU ~ a SwiGLU 28672 MLP
    "175b": _p("175b", 96, 12288, 96, 50304, 2048),  # GPT-3's shape (Brown et al. 2020)
    # Llama architecture (workers/llama.py): the published shapes of TinyLlama-1.1B, Llama 3 8B and 70B,
    # trained at 2048 tokens (their configs allow 8192; raise seq_len in the job for longer contexts).
    "llama-tiny": _p("llama-tiny", 4, 32, 4, 64, 16, ffn=64, num_kv_heads=2),  # CPU tests, GQA 2:1
    "llama-1b": _p("llama-1b", 22, 2048, 32, 32000, 2048, ffn=5632, num_kv_heads=4),
    "llama-8b": _p("llama-8b", 32, 4096, 32, 128256, 2048, ffn=14336, num_kv_heads=8, rope_theta=500000.0),
    "llama-70b": _p("llama-70b", 80, 8192, 64, 128256, 2048, ffn=28672, num_kv_heads=8, rope_theta=500000.0),
}

def tokens_per_step(model: ModelSpec, global_batch: int) -> int:
    """Tokens one optimizer step trains: every sample is seq_len input tokens."""
    return global_batch * model.seq_len


BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}


class TrainSpec(StrictModel):
    global_batch: int = Field(ge=1, le=65536, description="samples per optimizer step, over all replicas")
    precision: Literal["bf16", "fp16", "fp32", "fp64"] = "bf16"
    optimizer: Literal["adamw"] = "adamw"
    lr: float = Field(default=3e-4, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float | None = Field(default=1.0, gt=0, description="global-norm clip; null = off")
    memory_reserve_gib: float = Field(
        default=2.0, ge=0, description="per-device memory kept free (allocator, CUDA context)"
    )
    max_micro_batch_size: int = Field(default=64, ge=1, le=65536)
    seed: int = 0
    eval_every: int = Field(default=0, ge=0, description="a validation loss every this many steps, between steps "
                            "(0: none); held-out data from data.val_fraction or data.val_path")
    eval_samples: int = Field(default=0, ge=0, description="held-out samples each evaluation reads, a multiple of "
                              "global_batch (0: one global batch)")
    epochs: float | None = Field(default=None, gt=0, le=1e6, description="bound the job by passes over the corpus "
                                 "instead of `steps`: the job trains ceil(epochs x the corpus's training windows / "
                                 "global_batch) steps (a file or shards; not synthetic data)")

    @model_validator(mode="after")
    def _eval_whole_batches(self) -> TrainSpec:
        if self.eval_samples % self.global_batch:
            raise ValueError(f"eval_samples {self.eval_samples} is not a multiple of global_batch "
                             f"{self.global_batch} (an evaluation is split across replicas as a step is); use "
                             f"{max(1, round(self.eval_samples / self.global_batch)) * self.global_batch}")
        return self

    @property
    def eval_batches(self) -> int:
        """The global batches one evaluation reads."""
        return max(1, self.eval_samples // self.global_batch)

    @cached_property
    def param_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element: accumulated and reduced in fp32 under mixed precision (the runtime's
        fp32 master gradients, as Megatron's main_grad), else in the parameters' dtype."""
        return 4 if self.param_bytes < 4 else self.param_bytes

    @property
    def state_bytes_per_param(self) -> int:
        """Bytes per parameter the state tiers hold and move (snapshots, drains, restores, S3): the master copy
        (the parameter itself unless mixed) and AdamW's two moments. A bf16/fp16 working copy is not moved: it
        is cut from the master on load."""
        return 3 * self.grad_bytes

    @property
    def optimizer_bytes_per_param(self) -> int:
        """AdamW state: m and v in fp32 (fp64 for fp64), plus an fp32 master copy when mixed."""
        if self.precision == "fp64":
            return 16
        return 12 if self.param_bytes < 4 else 8
