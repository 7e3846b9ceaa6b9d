"""Bad training data is refused before any cluster starts: exit 2 in seconds, one message naming data.path."""


import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from orchestrator.cli.main import app

pytestmark = pytest.mark.unit
runner = CliRunner()
CLUSTER = {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 1}]}


def _job(tmp_path, data, vocab=64):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"model": {"preset": "tiny", "vocab_size": vocab}, "train": {"global_batch": 4},
                                 "cluster": CLUSTER, "data": data, "steps": 2}))
    return f


def _folder(tmp_path, name, files: dict | None = None):
    p = tmp_path / name
    p.mkdir()
    for f, payload in (files or {}).items():
        (p / f).write_bytes(payload)
    return str(p)


def _write(tmp_path, name, payload: bytes):
    p = tmp_path / name
    p.write_bytes(payload)
    return str(p)


CASES = {
    "missing": (lambda t: {"kind": "tokens", "path": str(t / "nonexistent.bin")}, "does not exist"),
    "empty-folder": (lambda t: {"kind": "tokens", "path": _folder(t, "shards")}, "a folder with no files in it"),
    "bad-shard": (lambda t: {"kind": "tokens", "path": _folder(t, "corpus", {"a.bin": bytes(4000), "b.bin": b"x" * 7})},
                  "shard"),
    "empty": (lambda t: {"kind": "tokens", "path": _write(t, "e.bin", b"")}, "is empty"),
    "odd-sized": (lambda t: {"kind": "tokens", "path": _write(t, "o.bin", b"\x01" * 1001)},
                  "not a multiple of 2 (uint16)"),
    "ten-tokens": (lambda t: {"kind": "tokens", "path": _write(t, "s.bin", np.arange(10, dtype=np.uint16).tobytes())},
                   "holds 10 tokens"),
    "ids-past-vocab": (lambda t: {"kind": "tokens", "path": _write(
        t, "r.bin", np.random.default_rng(0).integers(0, 65535, 5000, dtype=np.uint16).tobytes())},
        "but model.vocab_size is 64"),
    "uint32-ids-past-vocab": (lambda t: {"kind": "tokens", "dtype": "uint32", "path": _write(
        t, "r4.bin", np.full(100, 70000, dtype=np.uint32).tobytes())}, "token id 70000"),
    "text-bytes-past-vocab": (lambda t: {"kind": "text", "path": _write(t, "t.txt", "héllo wörld ".encode() * 20)},
                              "set model.vocab_size >= 256"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_exits_2_fast_without_ray(tmp_path, case):
    import ray

    make, needle = CASES[case]
    job = _job(tmp_path, make(tmp_path))
    res = runner.invoke(app, ["submit", str(job)])
    assert res.exit_code == 2, res.output
    assert "data.path" in res.output and needle in res.output, res.output
    assert "Traceback" not in res.output and res.output.count("error:") == 1
    assert not ray.is_initialized()  # refused before any Ray cluster started (what "fast" meant)
    assert not ray.is_initialized()  # no cluster was started


def test_good_token_file_passes_the_check(tmp_path):
    from orchestrator.api import check_data
    from orchestrator.job_spec import load_job

    path = _write(tmp_path, "ok.bin", np.arange(500, dtype=np.uint16).tobytes())
    check_data(load_job(_job(tmp_path, {"kind": "tokens", "path": path}, vocab=500)), "job")


def test_worker_side_check_names_the_file(tmp_path):
    """A file that changes after the up-front check is still caught as the worker reads it."""
    from workers.data import TokenFile
    from workers.data_validation import DataError

    path = _write(tmp_path, "late.bin", np.full(200, 9, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match=r"late\.bin: token id 9 at token \d+ is not below model\.vocab_size=8"):
        TokenFile(path, 16, vocab_size=8).batch(range(2))


def test_a_validation_loss_without_held_out_data_or_whole_batches_exits_2_naming_the_field(tmp_path):
    path = _write(tmp_path, "t.bin", np.random.default_rng(0).integers(0, 64, 17 * 40, dtype=np.uint16).tobytes())
    cases = [  # (data, train, what the one line says)
        ({"kind": "tokens", "path": path}, {"eval_every": 2}, "train.eval_every needs held-out data"),
        ({"kind": "tokens", "path": path, "val_fraction": 0.001}, {"eval_every": 2},
         "data.val_fraction 0.001 of the corpus's"),
        ({"kind": "tokens", "path": path, "val_fraction": 0.05}, {"eval_every": 2},
         "holds 2 samples; an evaluation reads train.eval_samples = 4"),
        ({"kind": "synthetic"}, {"eval_every": 2, "eval_samples": 6},
         "eval_samples 6 is not a multiple of global_batch"),
    ]
    for data, train, needle in cases:
        f = tmp_path / "job.yaml"
        f.write_text(yaml.safe_dump({"model": {"preset": "tiny", "vocab_size": 64},
                                     "train": {"global_batch": 4, **train}, "cluster": CLUSTER, "data": data,
                                     "steps": 2}))
        res = runner.invoke(app, ["submit", str(f)])
        assert res.exit_code == 2, (data, train, res.output)
        assert needle in " ".join(res.output.split()) and "Traceback" not in res.output, (needle, res.output)


def test_train_epochs_bound_the_job_and_bad_bounds_exit_2_naming_the_field(tmp_path):
    """train.epochs: the job trains ceil(epochs x an epoch's samples / global_batch) steps, an epoch being the
    corpus's windows less the held-out ones; with synthetic data, or beside a different `steps`, exit 2."""
    from orchestrator.api import check_data
    from orchestrator.job_spec import load_job

    path = _write(tmp_path, "t.bin", np.random.default_rng(0).integers(0, 64, 17 * 50 + 9, dtype=np.uint16).tobytes())

    def job(data, train, **top):
        f = tmp_path / "job.yaml"
        f.write_text(yaml.safe_dump({"model": {"preset": "tiny", "vocab_size": 64},
                                     "train": {"global_batch": 4, **train}, "cluster": CLUSTER, "data": data} | top))
        return f

    tokens = {"kind": "tokens", "path": path}
    assert check_data(load_job(job(tokens, {"epochs": 1.5})), "job").steps == 19  # 75 samples of 50 windows
    held = tokens | {"val_fraction": 0.2}  # 40 windows to train on
    assert check_data(load_job(job(held, {"epochs": 2})), "job").steps == 20
    assert check_data(load_job(job(held, {"epochs": 2}, steps=20)), "job").steps == 20  # both, agreeing
    for data, train, top, needle in [
        ({"kind": "synthetic"}, {"epochs": 1}, {}, "train.epochs counts passes over a corpus"),
        (tokens, {"epochs": 1}, {"steps": 5}, "steps (5) and train.epochs (1: 13 steps of 4 samples over 50 windows)"),
        (tokens, {"epochs": 0}, {}, "field 'train.epochs'"),
    ]:
        res = runner.invoke(app, ["submit", str(job(data, train, **top))])
        text = " ".join(res.output.split())
        assert res.exit_code == 2 and needle in text and "Traceback" not in text, (needle, text)
