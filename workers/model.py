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

import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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


class _Embed(torch.autograd.Function):
    """Rows of an embedding table; backward adds the gradient into the rows with `index_add_`.

    torch's own embedding backward on CUDA sorts the ids and reads the count of distinct ones on the host (a
    stream synchronization inside backward: pytorch/pytorch#20655); `index_add_` accumulates with atomics and
    reads nothing. The rows are accumulated in float32 under bf16/fp16 (as torch's kernel does).
    """

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.shape = weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        rows = torch.zeros(ctx.shape, dtype=wide, device=grad.device)
        rows.index_add_(0, ids.reshape(-1), grad.reshape(-1, ctx.shape[1]).to(wide))
        return None, rows.to(grad.dtype)


def embed(ids: torch.Tensor, weight: torch.Tensor, start: int = 0, vocab: int | None = None) -> torch.Tensor:
    """Look up `ids` in a table holding rows [start, start + len(weight)) of a `vocab`-row vocabulary (the
    whole table when `vocab` is None or the rows are all of it). Ids outside the rows held give zero rows, so
    the TP ranks' lookups sum to the whole table's (a vocabulary-parallel embedding, Megatron-LM's
    VocabParallelEmbedding: the sum is the all-reduce that follows)."""
    if vocab is None or weight.shape[0] == vocab:
        return _Embed.apply(ids, weight)
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    out = _Embed.apply(local.masked_fill(~inside, 0), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of logits split over a TP group by vocabulary (Megatron-LM's
    vocab_parallel_cross_entropy): the max, the softmax's denominator and the target's logit are all-reduced
    over the group, so no rank gathers the whole logits ([tokens, vocab] is the largest activation of a model
    with a large vocabulary). Backward is local: softmax minus the target's one-hot, on this rank's rows."""

    @staticmethod
    def forward(ctx, logits, targets, start, group):
        rows = logits.shape[-1]
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        z = logits - top.unsqueeze(-1)
        e = z.exp()
        total = e.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - start
        inside = (local >= 0) & (local < rows)
        local = local.masked_fill(~inside, 0)
        picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1) * inside
        dist.all_reduce(picked, group=group)
        e.div_(total.unsqueeze(-1))  # this rank's part of the softmax, kept for backward
        ctx.save_for_backward(e, local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        soft, local, inside = ctx.saved_tensors
        g = soft * grad.unsqueeze(-1)
        g.scatter_add_(-1, local.unsqueeze(-1), (-grad * inside).unsqueeze(-1).to(g.dtype))
        return g, None, None, None


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
        vocab = (embed_params(model) + head_params(model))[0]  # the token embedding: its rows' split is the head's
        self.vocab_start = vocab.local_slice(tp_rank, tp_size)[0].start or 0  # first vocabulary row this rank holds
        self.params: dict[str, torch.nn.Parameter] = {}
        self._rope: dict = {}  # (seq, dtype, device) -> the Llama's cos/sin tables
        start = None
        if model.init_from:  # fine-tuning: the weights of a Hugging Face directory (workers/hf_format.py)
            from workers.hf_format import read_weights

            start = read_weights(model.init_from, model, {s.name: s.shape for s in specs})  # this stage's
        def local(s: ParamSpec) -> torch.Tensor:
            full = start[s.name].to(dtype) if start is not None else init_full(s, seed, dtype)
            return full[s.local_slice(tp_rank, tp_size)].clone()

        # Each tensor has a generator of its own (seeded by its name), so they are drawn in parallel with the same
        # values as one after another: a 1.3B stage's draw took 56 s of one core before (a cold start's largest
        # segment on a GPU machine); torch's generators release the GIL.
        with ThreadPoolExecutor(max(1, min(len(specs), os.cpu_count() or 1, 32))) as pool:
            tensors = list(pool.map(local, specs))
        for s, t in zip(specs, tensors, strict=True):
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
        if self.first:
            wait(-1)
            x = self._embed(x)
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
            x = F.linear(_copy(x, self.tp_group), self.params["lm_head.weight"])  # this rank's vocabulary rows
        return x

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token (and, for the GPT, position) embeddings. Positions are a slice of their table, not a gather by a
        host-made index (which would copy the index to the device, and wait for it, every micro-batch)."""
        name = "model.embed_tokens.weight" if self.m.arch == "llama" else "wte.weight"
        x = embed(ids, self.params[name], self.vocab_start, self.m.vocab_size)
        if self.tp_group is not None:  # each rank looked up its rows of the vocabulary: their sum is the lookup
            x = _reduce(x, self.tp_group)
        if self.m.arch == "gpt":
            x = x + self.params["wpe.weight"][: ids.shape[1]]
        return x

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum over samples of each sample's mean token cross-entropy (from this rank's vocabulary rows of the
        logits under TP: `_VocabParallelCE`)."""
        wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # fp32, as planned
        if self.tp_group is not None:
            per_token = _VocabParallelCE.apply(wide, targets, self.vocab_start, self.tp_group)
        else:
            per_token = F.cross_entropy(wide.reshape(-1, wide.shape[-1]), targets.reshape(-1),
                                        reduction="none").view(targets.shape)
        return per_token.mean(dim=1).sum()
