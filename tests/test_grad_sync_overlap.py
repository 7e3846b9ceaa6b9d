"""Gradient sync overlapped with backward: the same training, and the all-reduce of layer k
launched before the backward of layer k-1 has finished. Two ranks (two processes, gloo), no Ray.
"""

import multiprocessing as mp

import pytest
import torch

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec
from tests.net import rendezvous_client, rendezvous_server

pytestmark = pytest.mark.unit
MODEL = ModelSpec.preset("tiny")  # 4 layers
TRAIN = TrainSpec(global_batch=8, lr=0.01, precision="fp32")
STEPS = 3


def _plan() -> Plan:
    """Two replicas (5 and 3 samples, two micro-batches each), one stage each: DP across two nodes."""
    def pipe(n, node):
        return Pipeline(num_samples=n, micro_batch_size=-(-n // 2), num_micro_batches=2, stages=[Stage(
            layer_start=0, layer_end=4, gpu_type="A100-80GB", node=node, devices=[f"{node}/0"])])
    return Plan(model_name="tiny", num_layers=4, global_batch=8, pipelines=[pipe(5, "a"), pipe(3, "b")])


def _rank(rank: int, ports: tuple[int, int], out) -> None:
    """Both modes in one process (one spawn per rank): overlapped, then after backward."""
    from workers.data import make_dataset
    from workers.engine import Engine

    torch.set_num_threads(1)
    for overlap, port in zip((True, False), ports, strict=True):
        e = Engine(_plan(), rank, MODEL, TRAIN, make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0),
                   torch.float64, overlap_sync=overlap)
        e.connect("", 30, store=rendezvous_client(port, 2, 30))
        try:
            losses = [e.step(s).loss for s in range(STEPS)]
            out.put((overlap, rank, losses, {n: p.detach().numpy().copy() for n, p in e.module.params.items()},
                     e.sync_trace))
        finally:
            e.close()


def run() -> dict[bool, list]:
    """Per mode (overlapped or not): per rank, (rank, losses, parameters, sync trace)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    servers = (rendezvous_server(2), rendezvous_server(2))  # both ranks rendezvous in these, one per mode
    ports = tuple(srv.port for srv in servers)
    procs = [ctx.Process(target=_rank, args=(r, ports, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in range(4)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return {mode: sorted((g[1:] for g in got if g[0] == mode), key=lambda g: g[0]) for mode in (True, False)}


def test_overlapped_sync_trains_identically_and_starts_each_layer_before_the_next_finishes():
    runs = run()
    over, serial = runs[True], runs[False]
    for (_, l1, p1, _), (_, l2, p2, _) in zip(over, serial, strict=True):
        assert l1 == l2 or all(abs(a - b) <= 1e-12 * abs(b) for a, b in zip(l1, l2, strict=True) if b is not None)
        for name in p1:
            torch.testing.assert_close(torch.from_numpy(p1[name]), torch.from_numpy(p2[name]), rtol=1e-12, atol=0)
    for rank, _, _, trace in over:
        ready = {layer: t for kind, layer, t in trace if kind == "ready"}
        launch = {layer: t for kind, layer, t in trace if kind == "launch"}
        assert set(launch) == set(range(-1, 5))  # embedding, 4 blocks, head: one bucket each
        for k in range(0, 5):  # the head (4) and every block: its all-reduce starts before layer k-1 is done
            assert launch[k] < ready[k - 1], (rank, k, trace)
    for rank, _, _, trace in serial:  # without overlap every all-reduce waits for the whole backward
        last_ready = max(t for kind, _, t in trace if kind == "ready")
        assert all(t > last_ready for kind, _, t in trace if kind == "launch"), (rank, trace)
