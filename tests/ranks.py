"""A plan trained by one process per rank (spawned, gloo, no Ray), for engine tests that need several ranks: the
losses, the full parameters assembled from every rank's shards, each rank's posted point-to-point batches, and
(with `eval_batches`) the validation loss of the trained weights on the synthetic held-out samples."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import torch

from tests.net import rendezvous_client, rendezvous_server


def _rank(rank: int, port: int, world: int, plan_json: str, model_json: str, train_json: str, dtype: str,
          steps: int, offloads: bool, device: str, out, eval_batches: int = 0) -> None:
    from planner import ModelSpec, Plan, TrainSpec
    from workers.data import SYNTHETIC_HELD_OUT, SyntheticCorpus, make_dataset
    from workers.engine import DTYPES, Engine
    from workers.state import export_shards, to_numpy

    torch.set_num_threads(1)
    plan, model, train = Plan.model_validate_json(plan_json), ModelSpec.model_validate_json(model_json), \
        TrainSpec.model_validate_json(train_json)
    e = Engine(plan, rank, model, train, make_dataset("synthetic", model.seq_len, model.vocab_size, train.seed),
               DTYPES[dtype], meter_memory=offloads, device=device, backend="gloo")
    try:
        e.connect("", 60, store=rendezvous_client(port, world, 60))
        results, posted = [], []
        for s in range(steps):
            results.append(e.step(s))
            posted.append(list(e.posted))
        held_out = SyntheticCorpus(model.vocab_size, model.seq_len, train.seed + SYNTHETIC_HELD_OUT)
        val = e.evaluate(held_out, eval_batches) if eval_batches else None
        out.put((rank, [r.loss for r in results], to_numpy(export_shards(e)), posted,
                 [r.extra["device_peak_bytes"] for r in results], val))
    except BaseException as err:  # noqa: BLE001 - the test reports it
        out.put((rank, f"{type(err).__name__}: {err}", None, None, None, None))
    finally:
        e.close()


def run_ranks(plan, model, train, dtype: str, steps: int, meter: bool = False, timeout_s: float = 240,
              device: str = "cpu", eval_batches: int = 0) -> dict:
    """Train `plan` with a process per rank (gloo; on CUDA, every rank on the one GPU). Returns {"losses": the
    global loss per step, "params": full tensors by name, "posted": {rank: per step [Exchange]}, "peaks": {rank: device
    meter peak per step}}."""
    from workers.state import assemble

    world = len(plan.devices())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    server = rendezvous_server(world, 60)
    procs = [ctx.Process(target=_rank, args=(r, server.port, world, plan.model_dump_json(), model.model_dump_json(),
                                             train.model_dump_json(), dtype, steps, meter, device, out,
                                             eval_batches))
             for r in range(world)]
    for p in procs:
        p.start()
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < world:  # a rank that dies without a word fails the run now, not at the timeout
        try:
            got.append(out.get(timeout=1))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"ranks {dead} died; {len(got)} of {world} reported"
    got.sort(key=lambda g: g[0])
    for p in procs:
        p.join(timeout=60)
    failed = [f"rank {r}: {losses}" for r, losses, *_ in got if isinstance(losses, str)]
    assert not failed, "; ".join(failed)
    reporting = [losses for _, losses, *_ in got if losses[0] is not None]
    assert len(reporting) == len(plan.pipelines)  # one reporting rank per replica: its samples' share of the loss
    shards = [{n: {k: torch.from_numpy(v) if hasattr(v, "dtype") and not isinstance(v, torch.Tensor) else v
                   for k, v in sh.items()} for n, sh in g[2].items()} for g in got]
    return {"losses": [sum(r[s] for r in reporting) for s in range(steps)], "params": assemble(shards),
            "posted": {r: posted for r, _, _, posted, _, _ in got}, "peaks": {r: peaks for r, *_, peaks, _ in got},
            "eval": sum(v for *_, v in got if v is not None) if eval_batches else None,
            "eval_reporting": sum(v is not None for *_, v in got)}
