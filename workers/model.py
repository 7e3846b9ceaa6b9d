"""A GPT decoder in the spirit of nanoGPT (and the Llama of workers/llama.py), split into pipeline stages and TP shards.

Read top to bottom (the canonical parameters, names and full shapes and how a TP rank slices them, are
workers/param_specs.py's, without torch): their initialisation, the two Megatron collectives, a transformer
block, and the stage that chains blocks between an optional embedding and an optional head.

- Pre-norm blocks, causal attention through `scaled_dot_product_attention`,
  GELU MLP, learned positions, untied embedding and LM head. No dropout.
- Parameter names ("h.3.attn.q.weight", ...) are plan-independent: they are the
  canonical state keys for checkpoints and recovery.
- Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): q, k, v and the MLP's
  first linear are column-parallel (split on output rows, heads stay whole), the
  attention output and MLP second linear are row-parallel (split on input
  columns). LayerNorms, the row-parallel biases, the embedding and the head are
  replicated in the TP group; their gradients are identical on every TP rank.
- Initialization draws each full tensor from a generator seeded by (seed, name),
  then slices it, so every plan starts from the same weights.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from planner.specs import ModelSpec
from workers import llama
from workers.param_specs import ParamSpec, all_params, block_params, embed_params, head_params  # noqa: F401


def init_full(spec: ParamSpec, seed: int, dtype: torch.dtype) -> torch.Tensor:
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    if spec.init == "zeros":
        return torch.zeros(spec.shape, dtype=dtype)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    return torch.randn(spec.shape, generator=g, dtype=torch.float64).mul_(0.02).to(dtype)


# -- Megatron's f and g: identity one way, all-reduce the other ------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _copy(x, group):
    return x if group is None else _CopyToTP.apply(x, group)


def _reduce(x, group):
    return x if group is None else _ReduceFromTP.apply(x, group)


class Stage(torch.nn.Module):
    """Blocks [layer_start, layer_end), with the embedding if first and the head if last."""

    def __init__(self, model: ModelSpec, layer_start: int, layer_end: int, first: bool, last: bool,
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None, seed: int = 0,
                 dtype: torch.dtype = torch.float32, recompute_layers: frozenset[int] = frozenset()):
        super().__init__()
        self.m, self.first, self.last = model, first, last
        self.layers = list(range(layer_start, layer_end))
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.tp_group = tp_group if tp_size > 1 else None
        self.recompute = recompute_layers
        self.store: Any = None  # a workers.offload.ParamStore when block weights live in host memory
        # called with -1 (embedding), a block index, or num_layers (head) before use
        self.before_layer: Callable[[int], None] | None = None
        specs = (embed_params(model) if first else []) + [p for i in self.layers for p in block_params(model, i)]
        specs += head_params(model) if last else []
        self.specs = {s.name: s for s in specs}
        self.params: dict[str, torch.nn.Parameter] = {}
        self._rope: dict = {}  # (seq, dtype, device) -> the Llama's cos/sin tables
        start = None
        if model.init_from:  # fine-tuning: the weights of a Hugging Face directory (workers/hf_format.py)
            from workers.hf_format import read_weights

            start = read_weights(model.init_from, model, {s.name: s.shape for s in specs})  # this stage's
        for s in specs:
            full = start[s.name].to(dtype) if start is not None else init_full(s, seed, dtype)
            t = full[s.local_slice(tp_rank, tp_size)].clone()
            self.params[s.name] = torch.nn.Parameter(t)
            self.register_parameter(s.name.replace(".", "__"), self.params[s.name])

    def _block(self, x: torch.Tensor, i: int) -> torch.Tensor:
        P, g = self.params, self.tp_group
        if self.store is not None and i in self.store.names:
            P = self.store.weights(i)  # device copies of host-resident weights
        if self.m.arch == "llama":
            key = (x.shape[1], x.dtype, x.device)
            if key not in self._rope:
                self._rope[key] = llama.rope_tables(self.m, *key)
            return llama.block(x, P, i, self.m, self.tp_size, g, _copy, _reduce, self._rope[key])
        pre = f"h.{i}."
        b, s, h = x.shape
        heads = self.m.num_heads // self.tp_size
        a = _copy(F.layer_norm(x, (h,), P[pre + "ln_1.weight"], P[pre + "ln_1.bias"]), g)
        q, k, v = (F.linear(a, P[pre + f"attn.{n}.weight"], P[pre + f"attn.{n}.bias"])
                   .view(b, s, heads, h // self.m.num_heads).transpose(1, 2) for n in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + _reduce(F.linear(y, P[pre + "attn.proj.weight"]), g) + P[pre + "attn.proj.bias"]
        a = _copy(F.layer_norm(x, (h,), P[pre + "ln_2.weight"], P[pre + "ln_2.bias"]), g)
        a = F.gelu(F.linear(a, P[pre + "mlp.fc.weight"], P[pre + "mlp.fc.bias"]))
        return x + _reduce(F.linear(a, P[pre + "mlp.proj.weight"]), g) + P[pre + "mlp.proj.bias"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: token ids [b, s] on the first stage, hidden states [b, s, h] elsewhere."""
        wait = self.before_layer or (lambda layer: None)
        if self.first and self.m.arch == "llama":
            wait(-1)
            x = F.embedding(x, self.params["model.embed_tokens.weight"])
        elif self.first:
            wait(-1)
            pos = torch.arange(x.shape[1])
            x = F.embedding(x, self.params["wte.weight"]) + self.params["wpe.weight"][pos]
        for i in self.layers:
            wait(i)
            if i in self.recompute:
                x = torch.utils.checkpoint.checkpoint(self._block, x, i, use_reentrant=False)
            else:
                x = self._block(x, i)
        if self.last:
            wait(self.m.num_layers)
            if self.m.arch == "llama":
                x = llama.rms_norm(x, self.params["model.norm.weight"], self.m.norm_eps)
            else:
                x = F.layer_norm(x, (x.shape[-1],), self.params["ln_f.weight"], self.params["ln_f.bias"])
            x = F.linear(x, self.params["lm_head.weight"])
        return x

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over samples of each sample's mean token cross-entropy."""
        flat = logits.reshape(-1, logits.shape[-1])  # in fp32 under mixed precision, as the planner counts it
        per_token = F.cross_entropy(flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat,
                                    targets.reshape(-1), reduction="none")
        return per_token.view(targets.shape).mean(dim=1).sum()
