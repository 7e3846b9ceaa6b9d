"""Hugging Face interop: a model trained by hetspot opens in `transformers` with the same logits,
and weights saved by `transformers` start a hetspot model with the same logits.

One rank, gloo with world size 1, no Ray (the multi-rank equivalence of the Llama is in
tests/test_train_ray.py). `transformers` is a test extra, imported lazily (it is slow to import).
"""

import json

import pytest
import torch

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
from workers import hf_format
from workers.data import make_dataset
from workers.engine import Engine
from workers.hf_config import HFFormatError, read_config, spec_fields

pytestmark = pytest.mark.unit
TRAIN = TrainSpec(global_batch=4, lr=0.01, precision="fp32")
GPT = ModelSpec.preset("tiny")
LLAMA = ModelSpec.preset("llama-tiny")


def trained(model: ModelSpec, steps: int = 3) -> tuple[Engine, dict[str, torch.Tensor]]:
    """A hetspot engine (one stage, float32) after `steps` optimizer steps, and its parameters."""
    st = Stage(layer_start=0, layer_end=model.num_layers, gpu_type="A100-80GB", node="a", devices=["a/0"])
    plan = Plan(model_name=model.name, num_layers=model.num_layers, global_batch=4,
                pipelines=[Pipeline(num_samples=4, micro_batch_size=4, num_micro_batches=1, stages=[st])])
    e = Engine(plan, 0, model, TRAIN, make_dataset("synthetic", model.seq_len, model.vocab_size, 0), torch.float32)
    e.connect_alone(30)
    start = {n: p.detach().clone() for n, p in e.module.params.items()}
    try:
        for s in range(steps):
            e.step(s)
        e.settle()
        params = {n: p.detach().clone() for n, p in e.module.params.items()}
        assert all(not torch.equal(params[n], start[n]) for n in params)  # every tensor trained
        return e, params
    finally:
        e.close()


def tokens(model: ModelSpec) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (3, model.seq_len), generator=torch.Generator().manual_seed(1))


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale, float((got - want).abs().max() / scale)


@pytest.mark.parametrize("model,hf_class", [(LLAMA, "LlamaForCausalLM"), (GPT, "GPT2LMHeadModel")])
def test_trained_model_exports_and_opens_in_transformers_with_the_same_logits(tmp_path, model, hf_class):
    import transformers

    e, params = trained(model)
    files = hf_format.write(tmp_path, model, params)
    assert {f.name for f in files} == {"config.json", "model.safetensors"}
    hf = getattr(transformers, hf_class).from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    x = tokens(model)
    with torch.no_grad():
        want = e.module(x)  # hetspot's logits: the same stage the engine trained
        got = hf(x).logits
    assert_logits_close(got, want)


@pytest.mark.parametrize("model", [LLAMA, GPT])
def test_weights_saved_by_transformers_start_a_hetspot_model_with_the_same_logits(tmp_path, model):
    """A random-init transformers model, saved by `save_pretrained`, read through `model: {init_from: DIR}`."""
    import transformers

    from orchestrator.job_spec import parse_job
    from workers.model import Stage as ModelStage

    torch.manual_seed(0)
    cfg = hf_format.hf_config(model)
    kind = transformers.LlamaConfig if model.arch == "llama" else transformers.GPT2Config
    hf = getattr(transformers, cfg["architectures"][0])(kind(**{k: v for k, v in cfg.items() if k != "architectures"}))
    hf.eval().save_pretrained(tmp_path)
    job = parse_job({"model": {"init_from": str(tmp_path)}, "train": {"global_batch": 4}, "steps": 1})
    spec = job.model_spec
    assert hf_format.hf_config(spec) == cfg and spec.init_from == str(tmp_path.resolve())
    ours = ModelStage(spec, 0, spec.num_layers, first=True, last=True)
    x = tokens(model)
    with torch.no_grad():
        assert_logits_close(ours(x), hf(x).logits)


def test_export_shards_above_the_size_limit_with_an_index(tmp_path):
    _, params = trained(LLAMA, steps=1)
    files = hf_format.write(tmp_path, LLAMA, params, max_shard_bytes=40_000)
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(files) > 3
    back = hf_format.read_weights(tmp_path, LLAMA, {n: tuple(t.shape) for n, t in params.items()})
    for name, t in params.items():
        torch.testing.assert_close(back[name], t)


@pytest.mark.parametrize("change,field", [
    ({"model_type": "mistral"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_configs_hetspot_cannot_train_are_refused_naming_the_field(change, field):
    with pytest.raises(HFFormatError, match=field):
        spec_fields(hf_format.hf_config(LLAMA) | change, "DIR")


def test_gpt2_with_the_tanh_gelu_is_refused():
    with pytest.raises(HFFormatError, match="activation_function.*gelu_new"):
        spec_fields(hf_format.hf_config(GPT) | {"activation_function": "gelu_new"}, "DIR")


def test_init_from_a_directory_without_config_says_what_it_needs(tmp_path):
    with pytest.raises(HFFormatError, match="no config.json"):
        read_config(tmp_path)


def test_cli_exports_a_jobs_s3_checkpoint_for_transformers(tmp_path, monkeypatch):
    """`hetspot checkpoints export s3://... --format hf --out DIR`: the newest complete step, read and verified
    from S3 (moto's server), opens in transformers with the trained model's logits; bad input exits 2."""
    import transformers
    from typer.testing import CliRunner

    from orchestrator.cli.main import app
    from orchestrator.state.s3_store import S3Checkpoints
    from tests.moto_s3 import moto_s3

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    e, params = trained(LLAMA)
    with moto_s3("jobs") as url:
        store = S3Checkpoints("s3://jobs/llama", url)
        for step, scale in ((1, 0.5), (2, 1.0)):  # the newest step is the one exported
            store.save(step, {n: {"param": t * scale, "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
                              for n, t in params.items()}, 3.0, {"model": LLAMA.model_dump()})
        out = tmp_path / "hf"
        r = CliRunner().invoke(app, ["checkpoints", "export", "s3://jobs/llama", "--endpoint-url", url,
                                     "--out", str(out), "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["step"] == 2
        again = CliRunner().invoke(app, ["checkpoints", "export", "s3://jobs/llama", "--endpoint-url", url,
                                         "--out", str(out)])
        assert again.exit_code == 2 and "not an empty directory" in again.output
        bad = CliRunner().invoke(app, ["checkpoints", "export", "s3://jobs/llama", "--endpoint-url", url,
                                       "--out", str(tmp_path / "x"), "--format", "gguf"])
        assert bad.exit_code == 2 and "--format 'gguf'" in bad.output
    hf = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    x = tokens(LLAMA)
    with torch.no_grad():
        assert_logits_close(hf(x).logits, e.module(x))
