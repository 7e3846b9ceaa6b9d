"""The model's parameters by canonical name: shape, TP shard dimension, layer and initialisation, for the GPT-2
and the llama layouts, without torch. The token embedding and the LM head are split over a TP group by vocabulary
rows (Megatron-LM's vocabulary-parallel embedding and head: workers/model.py), the largest tensors of a model
with a large vocabulary. The controller and the S3 tier list a model's units from these, and
workers/model.py builds its tensors from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.layout import EMBED, HEAD
from planner.specs import ModelSpec


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    shard_dim: int | None  # None: replicated across the TP group
    layer: int | str  # block index, EMBED or HEAD
    init: str  # "normal", "zeros" or "ones"

    def local_slice(self, tp_rank: int, tp_size: int) -> tuple[slice, ...]:
        """This TP rank's part: consecutive chunks of ceil(size / tp) along the shard dimension (equal where the
        contract requires it, heads and MLP rows; a vocabulary's last rank may hold fewer rows)."""
        if self.shard_dim is None or tp_size == 1:
            return tuple(slice(None) for _ in self.shape)
        size = self.shape[self.shard_dim]
        n = -(-size // tp_size)
        return tuple(slice(min(tp_rank * n, size), min((tp_rank + 1) * n, size)) if d == self.shard_dim
                     else slice(None) for d in range(len(self.shape)))


def block_params(m: ModelSpec, i: int) -> list[ParamSpec]:
    if m.arch == "llama":
        return _llama_block(m, i)
    h, f = m.hidden_size, m.ffn
    p = f"h.{i}."
    specs = [ParamSpec(p + "ln_1.weight", (h,), None, i, "ones"), ParamSpec(p + "ln_1.bias", (h,), None, i, "zeros")]
    for proj in ("q", "k", "v"):
        specs += [ParamSpec(p + f"attn.{proj}.weight", (h, h), 0, i, "normal"),
                  ParamSpec(p + f"attn.{proj}.bias", (h,), 0, i, "zeros")]
    specs += [
        ParamSpec(p + "attn.proj.weight", (h, h), 1, i, "normal"),
        ParamSpec(p + "attn.proj.bias", (h,), None, i, "zeros"),
        ParamSpec(p + "ln_2.weight", (h,), None, i, "ones"),
        ParamSpec(p + "ln_2.bias", (h,), None, i, "zeros"),
        ParamSpec(p + "mlp.fc.weight", (f, h), 0, i, "normal"),
        ParamSpec(p + "mlp.fc.bias", (f,), 0, i, "zeros"),
        ParamSpec(p + "mlp.proj.weight", (h, f), 1, i, "normal"),
        ParamSpec(p + "mlp.proj.bias", (h,), None, i, "zeros"),
    ]
    return specs


def embed_params(m: ModelSpec) -> list[ParamSpec]:
    if m.arch == "llama":
        return _llama_embed(m)
    return [ParamSpec("wte.weight", (m.vocab_size, m.hidden_size), 0, EMBED, "normal"),
            ParamSpec("wpe.weight", (m.seq_len, m.hidden_size), None, EMBED, "normal")]


def head_params(m: ModelSpec) -> list[ParamSpec]:
    if m.arch == "llama":
        return _llama_head(m)
    return [ParamSpec("ln_f.weight", (m.hidden_size,), None, HEAD, "ones"),
            ParamSpec("ln_f.bias", (m.hidden_size,), None, HEAD, "zeros"),
            ParamSpec("lm_head.weight", (m.vocab_size, m.hidden_size), 0, HEAD, "normal")]


def all_params(m: ModelSpec) -> list[ParamSpec]:
    return embed_params(m) + [p for i in range(m.num_layers) for p in block_params(m, i)] + head_params(m)



# -- the llama layout (workers/llama.py: its block) ------------------------------------------------------------
def _llama_block(m: ModelSpec, i: int) -> list[ParamSpec]:
    h, f, hd = m.hidden_size, m.ffn, m.head_dim
    p = f"model.layers.{i}."
    return [
        ParamSpec(p + "input_layernorm.weight", (h,), None, i, "ones"),
        ParamSpec(p + "self_attn.q_proj.weight", (m.num_heads * hd, h), 0, i, "normal"),
        ParamSpec(p + "self_attn.k_proj.weight", (m.kv_heads * hd, h), 0, i, "normal"),
        ParamSpec(p + "self_attn.v_proj.weight", (m.kv_heads * hd, h), 0, i, "normal"),
        ParamSpec(p + "self_attn.o_proj.weight", (h, m.num_heads * hd), 1, i, "normal"),
        ParamSpec(p + "post_attention_layernorm.weight", (h,), None, i, "ones"),
        ParamSpec(p + "mlp.gate_proj.weight", (f, h), 0, i, "normal"),
        ParamSpec(p + "mlp.up_proj.weight", (f, h), 0, i, "normal"),
        ParamSpec(p + "mlp.down_proj.weight", (h, f), 1, i, "normal"),
    ]


def _llama_embed(m: ModelSpec) -> list[ParamSpec]:
    return [ParamSpec("model.embed_tokens.weight", (m.vocab_size, m.hidden_size), 0, EMBED, "normal")]


def _llama_head(m: ModelSpec) -> list[ParamSpec]:
    return [ParamSpec("model.norm.weight", (m.hidden_size,), None, HEAD, "ones"),
            ParamSpec("lm_head.weight", (m.vocab_size, m.hidden_size), 0, HEAD, "normal")]
