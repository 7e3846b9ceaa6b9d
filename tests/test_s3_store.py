"""The S3 tier against moto's threaded server over HTTP: format, checksums, conditional manifest, fallback, keep."""

import logging

import boto3
import pytest
import torch

from orchestrator.state.s3_store import CheckpointError, S3Checkpoints, parse_uri
from tests.moto_s3 import moto_server

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def endpoint():
    with moto_server() as url:
        yield url


@pytest.fixture
def store(endpoint, request):
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=endpoint,
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    bucket = f"ckpt-{request.node.name.lower().replace('_', '-')[:40]}"
    client.create_bucket(Bucket=bucket)
    return S3Checkpoints(f"s3://{bucket}/jobs/tiny", client=client, multipart_bytes=6 << 20)


def state(seed: float, big: bool = False):
    g = torch.Generator().manual_seed(int(seed))
    rows = 2048 if big else 8
    return {"wte.weight": {"param": torch.randn(rows, 1024, generator=g),
                           "exp_avg": torch.randn(rows, 1024, generator=g),
                           "exp_avg_sq": torch.rand(rows, 1024, generator=g)},
            "ln_f.bias": {"param": torch.zeros(4), "exp_avg": torch.full((4,), seed), "exp_avg_sq": torch.ones(4)}}


def assert_same(a, b):
    assert set(a) == set(b)
    for name in a:
        for k in ("param", "exp_avg", "exp_avg_sq"):
            if a[name][k] is None:
                assert b[name][k] is None
            else:
                assert torch.equal(a[name][k], b[name][k])


def test_round_trip_with_multipart_and_sizes(store):
    s = state(1, big=True)  # 8 MiB tensors x 3: multipart above 6 MiB
    m = store.save(7, s, 8.0)
    assert m["units"]["wte.weight"]["bytes"] > 6 << 20
    got, opt_steps, nbytes = store.load(7)
    assert_same(got, s)
    assert opt_steps == 8.0
    assert nbytes == sum(u["bytes"] for u in m["units"].values())
    assert [(i.step, i.complete, i.num_objects) for i in store.steps()] == [(7, True, 3)]
    assert store.verify(7) == []


def test_manifest_is_written_once(store):
    store.save(3, state(1), 4.0)
    with pytest.raises(CheckpointError, match="step 3 already exists"):
        store.save(3, state(2), 4.0)
    assert_same(store.load(3)[0], state(1))  # the first write stands
    # two writers racing past that check: S3's conditional write lets only one manifest in
    with pytest.raises(Exception, match="PreconditionFailed|412"):
        store.client.put_object(Bucket=store.bucket, Key=store.manifest_key(3), IfNoneMatch="*", Body=b"{}")


def test_a_step_without_manifest_does_not_exist(store):
    store.save(1, state(1), 2.0)
    # a writer killed mid-upload: units of step 2 are there, its manifest is not
    store.client.put_object(Bucket=store.bucket, Key=store._key(2, "units/wte.weight/0-8.0-1024.safetensors"),
                            Body=b"half")
    assert [(i.step, i.complete) for i in store.steps()] == [(2, False), (1, True)]
    assert store.complete_steps() == [1]
    step, got, _, _ = store.load_latest()
    assert step == 1
    assert_same(got, state(1))


def test_flipped_byte_is_refused_and_the_previous_step_used(store, caplog):
    store.save(1, state(1), 2.0)
    store.save(2, state(2), 3.0)
    key = store.manifest(2)["units"]["wte.weight"]["pieces"][0]["key"]
    data = bytearray(store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    store.client.put_object(Bucket=store.bucket, Key=key, Body=bytes(data))  # moto accepts it: no checksum check
    with pytest.raises(CheckpointError, match="replaced since it was written"):  # by the listing's ETag
        store.load(2)
    assert len(store.verify(2)) == 1 and "wte.weight" in store.verify(2)[0]
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        step, got, opt, _ = store.load_latest()
    assert step == 1 and opt == 2.0
    assert_same(got, state(1))
    assert "refusing checkpoint step 2" in caplog.text and key in caplog.text


def test_truncated_manifest_is_refused(store, caplog):
    store.save(1, state(1), 2.0)
    store.save(2, state(2), 3.0)
    key = store.manifest_key(2)
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"].read()
    store.client.put_object(Bucket=store.bucket, Key=key, Body=body[: len(body) // 2])
    with caplog.at_level(logging.WARNING, logger="hetspot.checkpoints"):
        assert store.load_latest()[0] == 1
    assert "not valid JSON (truncated?)" in caplog.text


def test_keep_newest_deletes_old_and_half_written_steps(store):
    for s in (1, 2, 3, 4):
        store.save(s, state(s), float(s))
    store.client.put_object(Bucket=store.bucket, Key=store._key(0, "units/x.safetensors"), Body=b"old half")
    store.client.put_object(Bucket=store.bucket, Key=store._key(5, "units/x.safetensors"), Body=b"in flight")
    assert store.keep_newest(2).deleted == [0, 1, 2]
    assert [(i.step, i.complete) for i in store.steps()] == [(5, False), (4, True), (3, True)]  # in-flight kept


@pytest.mark.parametrize("uri", ["s3:/b/x", "gs://bucket/x", "s3://B/x", "s3://a/x", "bucket/x", ""])
def test_malformed_uri(uri):
    with pytest.raises(ValueError, match="s3://BUCKET/PREFIX"):
        parse_uri(uri)


def test_uri_parts():
    assert parse_uri("s3://my-bucket/runs/a/") == ("my-bucket", "runs/a")
    assert parse_uri("s3://my-bucket") == ("my-bucket", "")


def _meta(job: str) -> dict:
    return {"job": job, "run_id": "r1"}


def test_prefixes_are_directories_job1_never_sees_job10(endpoint):
    """Each job lists, prunes, verifies and resumes only its own steps."""
    client = boto3.client("s3", region_name="us-east-1", endpoint_url=endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing")
    client.create_bucket(Bucket="shared")
    job1 = S3Checkpoints("s3://shared/job1", client=client)
    job10 = S3Checkpoints("s3://shared/job10", client=client)
    for s in (1, 2):
        job1.save(s, state(s), float(s), _meta("job1"))
    for s in (5, 6, 7, 8):  # newer steps next door
        job10.save(s, state(s + 10), float(s), _meta("job10"))
    assert job1.complete_steps() == [2, 1] and job10.complete_steps() == [8, 7, 6, 5]
    assert job1.newest_whole() == (2, _meta("job1"))
    assert job1.keep_newest(1).deleted == [1]  # job10's newer steps neither count nor go
    assert job10.complete_steps() == [8, 7, 6, 5] and job1.complete_steps() == [2]
    assert job10.keep_newest(2).deleted == [5, 6] and job1.complete_steps() == [2]
    assert job1.verify(2) == [] and job1.load_latest()[0] == 2
    assert_same(job1.load(2)[0], state(2))
    job1.delete_step(2)
    assert job10.complete_steps() == [8, 7]
    root = S3Checkpoints("s3://shared", client=client)  # the bucket's root holds no step of its own
    assert root.steps() == []


def test_a_manifest_short_of_the_model_is_never_written(store):
    s = state(1)
    pieces = {"wte.weight": [store.put_piece(3, "wte.weight", ((0, 8), (0, 1024)), s["wte.weight"])]}
    model_units = {"wte.weight": [8, 1024], "ln_f.bias": [4]}
    with pytest.raises(CheckpointError, match=r"covers? 1 of the model's 2 units \(missing ln_f.bias\)"):
        store.write_manifest(3, {"wte.weight": [8, 1024]}, pieces, 1.0, _meta("tiny"), model_units)
    half = {"wte.weight": [store.put_piece(3, "wte.weight", ((0, 4), (0, 1024)),
                                           {k: v[:4] for k, v in s["wte.weight"].items()})]}
    with pytest.raises(CheckpointError, match="missing wte.weight"):  # a unit's pieces must tile it
        store.write_manifest(3, {"wte.weight": [8, 1024]}, half, 1.0, _meta("tiny"), {"wte.weight": [8, 1024]})
    assert store.complete_steps() == []


def _half_manifest(store, step: int, job: str = "tiny") -> None:
    """A manifest as the old uploader wrote after a node loss: it lists fewer units than the model has."""
    import json
    import time

    s = state(step)
    piece = store.put_piece(step, "wte.weight", ((0, 8), (0, 1024)), s["wte.weight"])
    units = {"wte.weight": {"shape": [8, 1024], "pieces": [piece], "bytes": piece["bytes"]}}
    m = {"format": "hetspot-checkpoint/3", "step": step, "optimizer_steps": float(step), "written_at": time.time(),
         "meta": _meta(job), "model_units": {"wte.weight": [8, 1024], "ln_f.bias": [4]}, "units": units}
    store.client.put_object(Bucket=store.bucket, Key=store.manifest_key(step), Body=json.dumps(m).encode())


def test_half_steps_never_count_for_keep_and_their_redo_replaces_them(store):
    for s in (1, 2):
        store.save(s, state(s), float(s), _meta("tiny"))
    for s in (3, 4):
        _half_manifest(store, s)
    assert "not whole" in store.verify(3)[0] and "ln_f.bias" in store.verify(3)[0]
    with pytest.raises(CheckpointError, match="not whole"):
        store.load(4)
    assert store.load_latest()[0] == 2 and [m["step"] for m in store.manifests()] == [2, 1]
    assert store.newest_whole()[0] == 2
    # keep 1: the half steps go, and the last whole step stays whatever is newer
    assert store.keep_newest(1).deleted == [1, 3, 4]
    assert store.complete_steps() == [2]
    _half_manifest(store, 3)
    assert store.prepare_step(3, "tiny") == "new"  # the redo of a half step replaces it
    assert store.complete_steps() == [2]
    store.save(3, state(3), 3.0, _meta("tiny"))
    assert store.verify(3) == [] and store.load_latest()[0] == 3
    assert store.prepare_step(3, "tiny") == "exists"  # a whole step is never touched
    assert store.prepare_step(3, "tiny", bad=True) == "new"  # unless a restore refused it as corrupt
    assert store.complete_steps() == [2]
    store.save(3, state(3), 3.0, _meta("tiny"))
    with pytest.raises(CheckpointError,
                       match=r"step 3 not written: .* stands \(step 3 was written by job 'tiny', not 'other'\)"):
        store.prepare_step(3, "other")
