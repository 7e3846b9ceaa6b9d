"""The Llama architecture beside the GPT: its block (its canonical parameters are in workers/param_specs.py).

RMSNorm, rotary position embeddings (RoPE), grouped-query attention (GQA:
`num_kv_heads` key/value heads shared by groups of query heads), a SwiGLU MLP,
no biases, untied embedding and LM head: the decoder of Llama 2/3 and of most
open models trained today.

Canonical names are those of Hugging Face `transformers`' `LlamaForCausalLM`
("model.layers.3.self_attn.q_proj.weight", ...), and the RoPE layout is theirs
(`rotate_half` over the two halves of each head), so an export to that format is
a copy of the tensors by name (workers/hf_format.py) and a checkpoint saved
by `transformers` imports without any permutation.

Tensor parallelism (Megatron-LM), as for the GPT (workers/model.py): q, k, v,
gate and up are column-parallel (split on output rows: whole query heads and
whole key/value heads per rank, so `num_kv_heads % tp == 0`); o and down are
row-parallel (split on input columns); the norms, the embedding and the head are
replicated in the TP group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from planner.specs import ModelSpec


class _RMSNorm(torch.autograd.Function):
    """transformers' LlamaRMSNorm, computed the same way (normalised in float32 or wider, scaled in the input's
    dtype), keeping for backward only the input and the per-token scale: autograd through the same expression
    keeps float32 copies of the normalised input, two tensors of 4 bytes per activation for each norm (under
    bf16 that was 16 bytes per token and hidden unit per layer, more than the layer's own bf16 activations)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        wide = x.to(torch.float32) if x.dtype in (torch.float16, torch.bfloat16) else x
        scale = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return weight * (wide * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, scale = ctx.saved_tensors
        wide = x.to(scale.dtype)
        normed = wide * scale
        g_weight = (grad * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g_normed = (grad * weight).to(scale.dtype)
        g_x = scale * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
        return g_x.to(x.dtype), g_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32 (or wider), scale in the input's dtype."""
    return _RMSNorm.apply(x, weight, eps)


def rope_tables(m: ModelSpec, seq: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] of the rotary embedding (the two halves of a head share frequencies)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    inv = 1.0 / (m.rope_theta ** (torch.arange(0, m.head_dim, 2, dtype=wide, device=device) / m.head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=wide, device=device), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def block(x: torch.Tensor, P: dict, i: int, m: ModelSpec, tp_size: int, group, copy, reduce,
          rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One Llama block on this TP rank's shards; `copy` and `reduce` are Megatron's f and g."""
    pre = f"model.layers.{i}."
    b, s, _ = x.shape
    hd, heads, kv = m.head_dim, m.num_heads // tp_size, m.kv_heads // tp_size
    cos, sin = rope
    a = copy(rms_norm(x, P[pre + "input_layernorm.weight"], m.norm_eps), group)
    q = F.linear(a, P[pre + "self_attn.q_proj.weight"]).view(b, s, heads, hd).transpose(1, 2)
    k = F.linear(a, P[pre + "self_attn.k_proj.weight"]).view(b, s, kv, hd).transpose(1, 2)
    v = F.linear(a, P[pre + "self_attn.v_proj.weight"]).view(b, s, kv, hd).transpose(1, 2)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    if kv != heads:  # GQA: each key/value head serves heads // kv query heads
        k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
    x = x + reduce(F.linear(y, P[pre + "self_attn.o_proj.weight"]), group)
    a = copy(rms_norm(x, P[pre + "post_attention_layernorm.weight"], m.norm_eps), group)
    a = F.silu(F.linear(a, P[pre + "mlp.gate_proj.weight"])) * F.linear(a, P[pre + "mlp.up_proj.weight"])
    return x + reduce(F.linear(a, P[pre + "mlp.down_proj.weight"]), group)
