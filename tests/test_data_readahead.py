"""Training data at GPU speed: only the stages that consume tokens read them (a middle stage of a
pipeline never does), and S3 data is read ahead of the step with each micro-batch's windows fetched side by side,
giving exactly the batches a local file gives. Three ranks (processes, gloo) for the pipeline; moto's server behind
the drills' fault proxy (20 ms a request) for S3; bench/data_s3.py measures the step time on Ray."""

import multiprocessing as mp
import threading
import time

import numpy as np
import pytest
import torch

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
from tests.net import rendezvous_client, rendezvous_server

pytestmark = pytest.mark.unit
MODEL = ModelSpec.preset("tiny")  # 4 layers
TRAIN = TrainSpec(global_batch=8, lr=0.01, precision="fp32")
STEPS = 2


def _plan(stages: list[tuple[int, int]]) -> Plan:
    return Plan(model_name="tiny", num_layers=4, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=4, num_micro_batches=2, stages=[Stage(
            layer_start=a, layer_end=b, gpu_type="A100-80GB", node=f"n{i}", devices=[f"n{i}/0"])
            for i, (a, b) in enumerate(stages)])])


class CountingData:
    """The synthetic corpus, counting the batches a rank reads."""

    def __init__(self):
        from workers.data import make_dataset

        self.inner = make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0)
        self.vocab_size = self.inner.vocab_size
        self.reads = 0

    def batch(self, indices):
        self.reads += 1
        return self.inner.batch(indices)


def _rank(rank: int, stages, port: int, out) -> None:
    from workers.engine import Engine

    torch.set_num_threads(1)
    data = CountingData()
    e = Engine(_plan(stages), rank, MODEL, TRAIN, data, torch.float64)
    e.connect("", 30, store=rendezvous_client(port, len(stages), 30))
    try:
        losses = [e.step(s).loss for s in range(STEPS)]
        out.put((rank, data.reads, losses))
    finally:
        e.close()


def _run(stages) -> list[tuple[int, int, list]]:
    server = rendezvous_server(len(stages))  # held here while the ranks meet in it
    port = server.port
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, stages, port, out)) for r in range(len(stages))]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


def test_a_middle_stage_reads_no_data_and_the_pipeline_trains_as_one_device():
    three = _run([(0, 1), (1, 3), (3, 4)])
    reads = {rank: n for rank, n, _ in three}
    assert reads[1] == 0, reads  # the middle stage: neither inputs nor targets
    assert reads[0] == reads[2] == STEPS * 2  # the first (inputs) and the last (targets): each micro-batch once
    (_, _, one), = _run([(0, 4)])
    losses = [x for _, _, ls in three for x in ls if x is not None]
    assert len(losses) == STEPS and all(abs(a - b) <= 1e-10 * abs(b) for a, b in zip(losses, one, strict=True))


@pytest.fixture(scope="module")
def s3_tokens(tmp_path_factory):
    """A token file locally and the same bytes in moto's S3, behind a proxy that holds each request 20 ms."""
    from orchestrator.drills.s3_proxy import S3FaultProxy
    from tests.moto_s3 import CREDS, moto_s3, use_test_credentials

    use_test_credentials()
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, 200_000, dtype=np.uint16)
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    tokens.tofile(path)
    with moto_s3("data") as url:
        import boto3

        s3 = boto3.client("s3", endpoint_url=url, **CREDS)
        s3.put_object(Bucket="data", Key="tokens.bin", Body=path.read_bytes())
        proxy = S3FaultProxy(url)
        proxy.delay_s = 0.02
        yield str(path), proxy
        proxy.stop()


def test_s3_data_is_read_ahead_side_by_side_and_gives_the_local_files_batches(s3_tokens):
    from workers.data import ReadAhead, make_dataset

    path, proxy = s3_tokens
    local = make_dataset("tokens", MODEL.seq_len, MODEL.vocab_size, 3, path)
    remote = make_dataset("tokens", MODEL.seq_len, MODEL.vocab_size, 3, "s3://data/tokens.bin",
                          endpoint_url=proxy.url)
    assert isinstance(remote, ReadAhead)
    batches = [range(i * 16, (i + 1) * 16) for i in range(4)]
    # The proxy holds every request until the gate opens: asking ahead must return while they are held (it does
    # not wait for the bytes), and the held requests show how many windows are read side by side.
    proxy.gate = threading.Event()
    try:
        asked = threading.Thread(target=remote.prefetch, args=(batches,), daemon=True)
        asked.start()
        asked.join(30)
        assert not asked.is_alive(), "prefetch waited for the reads"
        deadline = time.monotonic() + 30
        while proxy.in_flight < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        held = proxy.in_flight
    finally:
        proxy.gate.set()
        proxy.gate = None
    got = [remote.batch(r) for r in batches]
    for r, b in zip(batches, got, strict=True):
        assert torch.equal(b, local.batch(r))
    arr = remote.inner.tokens
    assert arr.requests == 64  # one ranged GET per sample, each read once
    assert held >= 16, held  # side by side: every window thread had a request out at once (serially: one)
    again = remote.batch(batches[0])  # kept: a redone step reads from memory
    assert torch.equal(again, got[0]) and arr.requests == 64
