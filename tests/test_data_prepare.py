"""`hetspot data prepare`: text and JSON lines in, token shards out, through the CLI in-process.

A tiny BPE tokenizer is trained here with `tokenizers` on generated text (tests never read ../shared). The shards
hold each document's tokens and the end-of-text token, in order, cut at the shard size; a job's dataset reads them
as a corpus of shards and a tiny model trains on them; bad input exits 2 in one line naming what to fix.
"""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from orchestrator.cli.main import app

pytestmark = pytest.mark.unit
runner = CliRunner()
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls sing of ships and sealing wax".split()


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), int(rng.integers(5, 60)))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(_docs(200, seed=1), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path), tok


def _inputs(tmp_path, docs: list[str]) -> str:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text(docs[0])
    (folder / "b.txt").write_text(docs[1])
    (folder / "c.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs[2:])))
    return str(folder)


def test_prepare_writes_each_documents_tokens_and_end_of_text_in_order_and_they_train(tokenizer, tmp_path):
    from orchestrator.job_spec import parse_job
    from tests.oracle import one_device_losses
    from workers.data import TokenFile

    path, tok = tokenizer
    docs = _docs(60)
    out = tmp_path / "shards"
    res = runner.invoke(app, ["data", "prepare", _inputs(tmp_path, docs), "--tokenizer", path, "--out", str(out),
                              "--shard-mib", "0.002", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    eot = tok.token_to_id("<|endoftext|>")
    want = np.concatenate([np.array(tok.encode(d, add_special_tokens=False).ids + [eot]) for d in docs])
    shards = sorted(out.iterdir())
    assert len(shards) == len(got["shards"]) > 1 and got["dtype"] == "uint16" and got["eot_id"] == eot
    assert all(s.stat().st_size <= int(0.002 * 2**20) for s in shards)
    read = np.concatenate([np.fromfile(s, dtype=np.uint16) for s in shards])
    assert np.array_equal(read, want) and got["tokens"] == len(want) and got["documents"] == 60
    assert tok.decode(read[:np.argmax(read == eot)].tolist()) == docs[0]
    data = TokenFile(str(out), 16, vocab_size=got["vocab_size"])
    assert data.order.windows == sum(s.stat().st_size // 2 // 17 for s in shards)
    job = parse_job({"name": "prepared", "model": {"name": "gpt-prepared", "num_layers": 2, "hidden_size": 32,
                                                   "num_heads": 4, "vocab_size": 320, "seq_len": 16},
                     "train": {"global_batch": 16, "lr": 0.01, "precision": "fp32"},
                     "data": {"kind": "tokens", "path": str(out), "dtype": "uint16"},
                     "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 1}]}, "steps": 12})
    losses = one_device_losses(job, 12)
    assert losses[-1] < losses[0] - 0.5, losses  # a text of 19 words repeated: learnable


def test_bad_input_exits_2_in_one_line_and_writes_nothing(tokenizer, tmp_path):
    from tokenizers import Tokenizer, models

    path, _ = tokenizer
    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70_000)} | {"<|endoftext|>": 70_000}, unk_token="w0"))
    big_path = tmp_path / "big.json"
    big.save(str(big_path))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("the fox")
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    one = str(tmp_path / "one.txt")
    cases = [
        ([one, "--tokenizer", str(tmp_path / "nope.json")], "is not a file: give the path of a tokenizer.json"),
        ([one, "--tokenizer", str(big_path), "--dtype", "uint16"], "use --dtype uint32"),
        ([str(tmp_path / "empty.txt"), "--tokenizer", path], "hold no text"),
        ([str(tmp_path / "missing.txt"), "--tokenizer", path], "does not exist"),
        ([str(tmp_path / "bad.jsonl"), "--tokenizer", path], "no text field 'text'; name the field with --field"),
        ([one, "--tokenizer", path, "--eot", "<nope>"], "is not a token of this tokenizer"),
    ]
    for i, (argv, needle) in enumerate(cases):
        res = runner.invoke(app, ["data", "prepare", *argv, "--out", str(tmp_path / f"out{i}")])
        assert res.exit_code == 2, (argv, res.output)
        line = " ".join(res.output.split())
        assert needle in line and "Traceback" not in res.output, (argv, res.output)
    res = runner.invoke(app, ["data", "prepare", one, "--tokenizer", path, "--out", str(tmp_path / "used")])
    assert res.exit_code == 2 and "not an empty folder" in res.output
    assert [p.name for p in (tmp_path / "used").iterdir()] == ["x"]
    res = runner.invoke(app, ["data", "prepare", one, "--tokenizer", str(big_path), "--out", str(tmp_path / "o32")])
    assert res.exit_code == 0 and "uint32" in res.output, res.output  # auto: the vocabulary needs 32 bits
