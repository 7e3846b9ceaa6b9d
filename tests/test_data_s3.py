"""Training data in S3: `data: {kind: tokens, path: s3://...}` on moto's server.

Each rank reads exactly the byte ranges of its samples; the windows are the local file's; a missing key, a
wrong dtype, a size that is not a whole number of tokens or refused access exits 2 before Ray starts; and a
job trains on the S3 file exactly as on the same file read locally (same losses), through the CLI.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tests.moto_s3 import CREDS, TEST_ENV, moto_s3

ENV = TEST_ENV
TOKENS = np.random.default_rng(3).integers(0, 64, 6000, dtype=np.uint16)


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3("data") as url:
        c = boto3.client("s3", endpoint_url=url, **CREDS)
        c.put_object(Bucket="data", Key="corpus/train.bin", Body=TOKENS.tobytes())
        c.put_object(Bucket="data", Key="corpus/odd.bin", Body=b"\x01" * 1001)
        c.put_object(Bucket="data", Key="corpus/u32.bin", Body=np.full(600, 70000, dtype=np.uint32).tobytes())
        yield url


@pytest.fixture(autouse=True)
def creds(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.unit
def test_windows_are_the_local_files_and_only_their_bytes_are_read(endpoint, tmp_path):
    from workers.data import TokenFile

    local = tmp_path / "train.bin"
    local.write_bytes(TOKENS.tobytes())
    s3 = TokenFile("s3://data/corpus/train.bin", 16, 64, endpoint_url=endpoint)
    want = TokenFile(str(local), 16, 64)
    for rows in (range(0, 3), range(3, 8), range(100, 101)):
        before = s3.tokens.bytes_read
        assert np.array_equal(s3.batch(rows).numpy(), want.batch(rows).numpy())
        assert s3.tokens.bytes_read - before == len(rows) * 17 * 2  # seq_len + 1 uint16 tokens a sample
    assert len(s3.tokens) == len(TOKENS)


def _job(tmp_path: Path, data: dict, endpoint: str, **extra) -> Path:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({
        "model": {"name": "gpt-data", "num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 64,
                  "seq_len": 16},
        "train": {"global_batch": 8, "lr": 0.01, "precision": "fp32"},
        "cluster": {"nodes": [{"name": "a", "gpu_type": "A100-80GB", "num_gpus": 1},
                              {"name": "b", "gpu_type": "L4", "num_gpus": 1}]},
        "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 20},
        "data": data | {"endpoint_url": endpoint}, "steps": 3} | extra))
    return f


BAD = {
    "missing-key": ({"kind": "tokens", "path": "s3://data/corpus/nope.bin"}, {},
                    "data.path 's3://data/corpus/nope.bin' does not exist at http"),
    "missing-bucket": ({"kind": "tokens", "path": "s3://nobucket/x.bin"}, {}, "does not exist"),
    "odd-size": ({"kind": "tokens", "path": "s3://data/corpus/odd.bin"}, {},
                 "has 1,001 bytes, not a multiple of 2 (uint16)"),
    "wrong-dtype": ({"kind": "tokens", "path": "s3://data/corpus/u32.bin"}, {},
                    "check that the file was written as uint16"),
    "bad-uri": ({"kind": "tokens", "path": "s3://Data/x"}, {}, "must look like s3://BUCKET/KEY"),
    "no-credentials": ({"kind": "tokens", "path": "s3://data/corpus/train.bin"}, {"drop_creds": True},
                       "no AWS credentials were found"),
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_s3_data_exits_2_before_ray_starts(endpoint, tmp_path, monkeypatch, case):
    import ray

    from orchestrator.cli.main import app

    data, how, needle = BAD[case]
    if how.get("drop_creds"):
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            monkeypatch.delenv(k)
        monkeypatch.setenv("HOME", str(tmp_path))
    res = CliRunner().invoke(app, ["submit", str(_job(tmp_path, data, endpoint))])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert needle in text and "data.path" in text and "Traceback" not in text and text.count("error:") == 1, text
    assert not ray.is_initialized()


@pytest.mark.ray
def test_a_job_on_s3_data_trains_exactly_like_on_the_local_file(endpoint, tmp_path):
    local = tmp_path / "train.bin"
    local.write_bytes(TOKENS.tobytes())
    runs = {}
    for name, path in (("local", str(local)), ("s3", "s3://data/corpus/train.bin")):
        d = tmp_path / name
        d.mkdir()
        job = _job(d, {"kind": "tokens", "path": path}, endpoint)
        r = subprocess.run([str(Path(sys.executable).parent / "hetspot"), "submit", str(job), "--json"],
                           capture_output=True, text=True, timeout=300, env=os.environ | ENV)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads(r.stdout)
    assert len(runs["s3"]["plan"]["pipelines"]) == len(runs["local"]["plan"]["pipelines"])
    assert runs["s3"]["losses"] == runs["local"]["losses"]  # the same windows in the same order: bit for bit


@pytest.mark.unit
def test_a_prefix_of_shards_reads_the_batches_of_the_same_local_folder(endpoint, tmp_path):
    """`data.path: s3://BUCKET/PREFIX/` is a corpus of the objects directly under it, in key order (a sub-folder's
    objects are not shards): the same batches, sample for sample, as the same files in a local folder."""
    from workers.data import TokenFile
    from workers.data_validation import check_data

    c = boto3.client("s3", endpoint_url=endpoint, **CREDS)
    folder = tmp_path / "shards"
    folder.mkdir()
    for i, n in enumerate((900, 1700, 400)):
        part = TOKENS[i * 1000:i * 1000 + n]
        part.tofile(folder / f"part-{i}.bin")
        c.put_object(Bucket="data", Key=f"sharded/part-{i}.bin", Body=part.tobytes())
    c.put_object(Bucket="data", Key="sharded/old/part-9.bin", Body=TOKENS[:50].tobytes())  # a sub-folder: not read
    check_data("tokens", "s3://data/sharded/", 16, 64, endpoint_url=endpoint)
    s3 = TokenFile("s3://data/sharded/", 16, 64, endpoint_url=endpoint)
    local = TokenFile(str(folder), 16, 64)
    assert len(s3.shards) == 3 and s3.order.windows == local.order.windows == 52 + 100 + 23
    for rows in (range(0, 40), range(170, 200)):  # the second crosses into the next epoch
        assert np.array_equal(s3.batch(rows).numpy(), local.batch(rows).numpy())
    with pytest.raises(ValueError, match="no files in it"):
        check_data("tokens", "s3://data/nothing-here/", 16, 64, endpoint_url=endpoint)


@pytest.mark.unit
def test_a_shard_changed_after_submit_is_refused_in_one_line(endpoint, tmp_path):
    """The submit indexes an s3:// prefix from its one listing (sizes and ETags) into the job: a worker opening a
    shard overwritten since refuses it naming the shard, one overwritten while a worker reads it is refused at the
    next GET (If-Match on the indexed ETag, with no block cache too), and a job file pinning an index that the
    corpus no longer matches exits 2 naming data.index."""
    from orchestrator.api import check_data
    from orchestrator.cli.main import app
    from orchestrator.job_spec import load_job
    from workers.data import make_datasets
    from workers.data_validation import DataError

    c = boto3.client("s3", endpoint_url=endpoint, **CREDS)
    for i in range(2):
        c.put_object(Bucket="data", Key=f"pinned/part-{i}.bin", Body=TOKENS[i * 2000:(i + 1) * 2000].tobytes())
    f = _job(tmp_path, {"kind": "tokens", "path": "s3://data/pinned/", "cache_gb": 0}, endpoint)
    job = check_data(load_job(f), "job.yaml")
    index = job.data.index
    assert [(e.path, e.bytes) for e in index.shards] == [(f"s3://data/pinned/part-{i}.bin", 4000) for i in range(2)]
    assert all(e.version.strip('"') for e in index.shards)
    data = job.data.model_dump()
    train = make_datasets(data, 16, 64)[0]
    train.batch(range(8))
    c.put_object(Bucket="data", Key="pinned/part-1.bin", Body=TOKENS[4000:6000].tobytes())  # same size, new ETag
    with pytest.raises(DataError, match=r"shard 's3://data/pinned/part-1\.bin' changed since the job was submitted "
                                        r"\(version "):
        make_datasets(data, 16, 64)
    with pytest.raises(DataError, match=r"'s3://data/pinned/part-1\.bin' changed while the job read it"):
        train.batch(range(0, 235))  # an epoch: some windows lie in part-1
    # a job file that pins the old index: refused before Ray starts, naming the shard that changed
    pinned = yaml.safe_load(f.read_text()) | {"data": data | {"index": index.model_dump()}}
    f.write_text(yaml.safe_dump(pinned))
    res = CliRunner().invoke(app, ["submit", str(f)])
    text = " ".join(res.output.split())
    assert res.exit_code == 2 and "Traceback" not in text, text
    assert "data.index: the corpus is not the one the job file pins (s3://data/pinned/part-1.bin is 4,000 bytes" in text
