"""Hugging Face configs (`config.json`) <-> ModelSpec, without torch: the job file reads them.

The tensors side is workers/hf_format.py; what maps and what is refused is described there.
"""

from __future__ import annotations

import json
from pathlib import Path

from planner.specs import ModelSpec

CONFIG = "config.json"


class HFFormatError(ValueError):
    """A directory or config that hetspot cannot read or train; the message names the field and the fix."""


def hf_config(m: ModelSpec) -> dict:
    if m.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
                "hidden_size": m.hidden_size, "intermediate_size": m.ffn, "num_hidden_layers": m.num_layers,
                "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
                "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                "torch_dtype": "float32"}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_heads, "n_inner": m.ffn,
            "n_positions": m.seq_len, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False,
            "torch_dtype": "float32"}


def spec_fields(cfg: dict, source: str) -> dict:
    """ModelSpec fields from a transformers config.json; HFFormatError for what hetspot cannot train."""
    try:
        return _spec_fields(cfg, source)
    except KeyError as e:
        raise HFFormatError(f"{source}: config.json has no {e.args[0]!r}; is it a transformers config?") from None


def _spec_fields(cfg: dict, source: str) -> dict:
    def refuse(field: str, why: str) -> HFFormatError:
        return HFFormatError(f"{source}: {field} {why}")

    kind = cfg.get("model_type")
    if kind == "llama":
        for field, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
            if cfg.get(field, want) != want:
                raise refuse(field, f"is {cfg[field]!r}; hetspot's Llama has {want!r}")
        if cfg.get("rope_scaling"):
            raise refuse("rope_scaling", "is set; hetspot's RoPE has no scaling (remove it, or train another model)")
        heads = cfg["num_attention_heads"]
        if cfg.get("head_dim", cfg["hidden_size"] // heads) * heads != cfg["hidden_size"]:
            raise refuse("head_dim", "times num_attention_heads must equal hidden_size here")
        return {"arch": "llama", "num_layers": cfg["num_hidden_layers"], "hidden_size": cfg["hidden_size"],
                "num_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads", heads),
                "ffn_size": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"],
                "seq_len": cfg.get("max_position_embeddings", 2048), "norm_eps": cfg.get("rms_norm_eps", 1e-6),
                "rope_theta": cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))}
    if kind == "gpt2":
        if cfg.get("activation_function", "gelu_new") != "gelu":
            raise refuse("activation_function", f"is {cfg.get('activation_function', 'gelu_new')!r}; hetspot's GPT "
                         "uses the exact GELU ('gelu'), so it would train a different model")
        if cfg.get("layer_norm_epsilon", 1e-5) != 1e-5:
            raise refuse("layer_norm_epsilon", "must be 1e-5 (hetspot's LayerNorm)")
        return {"arch": "gpt", "num_layers": cfg["n_layer"], "hidden_size": cfg["n_embd"], "num_heads": cfg["n_head"],
                "ffn_size": cfg.get("n_inner") or 4 * cfg["n_embd"], "vocab_size": cfg["vocab_size"],
                "seq_len": cfg.get("n_positions", 1024)}
    raise refuse("model_type", f"is {kind!r}; hetspot reads 'llama' (LlamaForCausalLM) and 'gpt2' (GPT2LMHeadModel)")


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise HFFormatError(f"{directory}: no {CONFIG}; init_from needs a Hugging Face model directory "
                            "(config.json and model.safetensors), e.g. from `hetspot checkpoints export`")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{path}: not a JSON config ({e})") from None


