"""Hugging Face format: export hetspot's canonical tensors to a `transformers` directory, and read one back.

One format serves recovery, export and fine-tuning: the tiered checkpoints store
each canonical parameter as a safetensors object (orchestrator/state/s3_store.py);
an export writes the same tensors under `transformers`' names with a
`config.json`, and `model: {init_from: DIR}` starts a job from such a directory.

- Llama (`LlamaForCausalLM`): hetspot's canonical names *are* transformers' names
  and the RoPE layout is the same (workers/llama.py): the tensors are copied.
- GPT (`GPT2LMHeadModel`): GPT-2 keeps q, k and v fused in one `c_attn` and
  stores every linear as `Conv1D` (weight [in, out]), so the export concatenates
  and transposes; the head is untied (`tie_word_embeddings: false`) and the MLP
  uses the exact GELU (`activation_function: gelu`). A GPT-2 checkpoint with the
  tanh GELU (`gelu_new`, the original GPT-2) cannot be trained exactly here and
  is refused; a tied one is imported with its head copied from the embedding
  (the two then train apart).

Files: `model.safetensors`, or shards `model-0000k-of-0000n.safetensors` with
`model.safetensors.index.json` above `max_shard_bytes` (transformers' layout).
No pickle anywhere: loading a shared checkpoint must not be able to run code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from planner.specs import ModelSpec
from workers.hf_config import CONFIG, HFFormatError, hf_config

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


# -- names ----------------------------------------------------------------------------
def _gpt_to_hf(state: dict[str, torch.Tensor], m: ModelSpec) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
           "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"],
           "lm_head.weight": state["lm_head.weight"]}
    for i in range(m.num_layers):
        p, q = f"h.{i}.", f"transformer.h.{i}."
        out[q + "attn.c_attn.weight"] = torch.cat([state[p + f"attn.{n}.weight"] for n in "qkv"]).t()
        out[q + "attn.c_attn.bias"] = torch.cat([state[p + f"attn.{n}.bias"] for n in "qkv"])
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[q + theirs + ".weight"] = state[p + ours + ".weight"].t()
            out[q + theirs + ".bias"] = state[p + ours + ".bias"]
        for n in ("ln_1", "ln_2"):
            out[q + n + ".weight"], out[q + n + ".bias"] = state[p + n + ".weight"], state[p + n + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}


def _gpt_from_hf(t: dict[str, torch.Tensor], m: ModelSpec) -> dict[str, torch.Tensor]:
    def get(name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("transformer.")):  # GPT2Model checkpoints have no prefix
            if key in t:
                return t[key]
        raise HFFormatError(f"the checkpoint has no tensor {name!r}")

    h = m.hidden_size
    out = {"wte.weight": get("transformer.wte.weight"), "wpe.weight": get("transformer.wpe.weight")[:m.seq_len],
           "ln_f.weight": get("transformer.ln_f.weight"), "ln_f.bias": get("transformer.ln_f.bias")}
    out["lm_head.weight"] = t.get("lm_head.weight", out["wte.weight"])  # tied in GPT-2: the head starts as a copy
    for i in range(m.num_layers):
        p, q = f"h.{i}.", f"transformer.h.{i}."
        w, b = get(q + "attn.c_attn.weight").t(), get(q + "attn.c_attn.bias")
        for j, n in enumerate("qkv"):
            out[p + f"attn.{n}.weight"], out[p + f"attn.{n}.bias"] = w[j * h:(j + 1) * h], b[j * h:(j + 1) * h]
        for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[p + ours + ".weight"] = get(q + theirs + ".weight").t()
            out[p + ours + ".bias"] = get(q + theirs + ".bias")
        for n in ("ln_1", "ln_2"):
            out[p + n + ".weight"], out[p + n + ".bias"] = get(q + n + ".weight"), get(q + n + ".bias")
    return {k: v.contiguous() for k, v in out.items()}


def to_hf(state: dict[str, torch.Tensor], m: ModelSpec) -> dict[str, torch.Tensor]:
    """Canonical parameters -> transformers' tensors for `m`'s architecture."""
    return dict(state) if m.arch == "llama" else _gpt_to_hf(state, m)


def from_hf(tensors: dict[str, torch.Tensor], m: ModelSpec) -> dict[str, torch.Tensor]:
    """transformers' tensors -> canonical parameters (every one the model has, else HFFormatError)."""
    if m.arch == "gpt":
        return _gpt_from_hf(tensors, m)
    out = dict(tensors)
    if "lm_head.weight" not in out and "model.embed_tokens.weight" in out:  # tied: the head starts as a copy
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# -- files ----------------------------------------------------------------------------
def write(directory: str | Path, m: ModelSpec, state: dict[str, torch.Tensor], max_shard_bytes: int = 5 * 2**30,
          dtype: torch.dtype = torch.float32) -> list[Path]:
    """Write config.json and the weights (sharded with an index above `max_shard_bytes`); the files written."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(m) | {"torch_dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in to_hf(state, m).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name], size = tensors[name], size + n
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE), metadata={"format": "pt"})
        return [out / CONFIG, out / SINGLE]
    files: list = []
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        f = out / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(f), metadata={"format": "pt"})
        files.append(f)
        weight_map |= {name: f.name for name in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return [out / CONFIG, out / INDEX, *files]


def read_weights(directory: str | Path, m: ModelSpec, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The canonical parameters named in `shapes` (workers.model's, for `m`) from a transformers directory,
    each checked against its shape."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if (d / INDEX).is_file():
        files = sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
    elif (d / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise HFFormatError(f"{d}: no {SINGLE} or {INDEX} (only safetensors weights are read, never pickle files)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors |= load_file(str(d / f))
        except (SafetensorError, OSError) as e:
            raise HFFormatError(f"{d / f}: not a readable safetensors file ({e})") from None
    state = from_hf(tensors, m)
    out = {}
    for name, shape in shapes.items():
        if name not in state:
            raise HFFormatError(f"{d}: the weights have no {name!r}; is config.json for these weights?")
        if tuple(state[name].shape) != tuple(shape):
            raise HFFormatError(f"{d}: {name} has shape {tuple(state[name].shape)}, the config implies {shape}")
        out[name] = state[name]
    return out
