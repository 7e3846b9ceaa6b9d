"""A process whose rendezvous failed joins the next one (two ranks, two processes, gloo, no Ray).

A kept worker can see a start-up fail: a rank of the new plan never came (a slow process, a node lost during the
start-up). The re-plan after it joins that same process to a new group beside fresh ones; torch names a group by a
counter in each process, so a failed rendezvous must leave the survivor naming its next world as a fresh process
does, or every start-up after it times out.
"""

import multiprocessing as mp

import pytest
import torch

from tests.net import rendezvous_client, rendezvous_server
from tests.test_grad_sync_overlap import MODEL, TRAIN, _plan  # two replicas, one stage each, on nodes a and b

pytestmark = pytest.mark.unit


def _engine(rank: int):
    from workers.data import make_dataset
    from workers.engine import Engine

    return Engine(_plan(), rank, MODEL, TRAIN, make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0),
                  torch.float64)


def _survivor(lone_port: int, port: int, out) -> None:
    """Rank 0 of a world whose rank 1 never comes (the start-up fails), then rank 0 of the next world."""
    torch.set_num_threads(1)
    first = _engine(0)
    try:
        first.connect("", 1, store=rendezvous_client(lone_port, 2, 5))
        out.put(("survivor", "the lone rendezvous did not fail"))
        return
    except Exception as e:  # noqa: BLE001 - the failure this test is about
        failed = type(e).__name__
    first.close()  # a kept process's reconfigure closes its old stage
    out.put(("survivor", _join_and_step(0, port), failed))


def _fresh(port: int, out) -> None:
    torch.set_num_threads(1)
    out.put(("fresh", _join_and_step(1, port)))


def _join_and_step(rank: int, port: int) -> float | str:
    e = _engine(rank)
    try:
        e.connect("", 10, store=rendezvous_client(port, 2, 30))
        return e.step(0).loss or 0.0
    except Exception as ex:  # noqa: BLE001 - reported to the test, which names it
        return f"{type(ex).__name__}: {ex}"[:300]
    finally:
        e.close()


def test_a_survivor_of_a_failed_rendezvous_joins_the_next_world_beside_a_fresh_process():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    lone, nxt = rendezvous_server(2), rendezvous_server(2)
    procs = [ctx.Process(target=_survivor, args=(lone.port, nxt.port, out))]
    procs[0].start()
    procs.append(ctx.Process(target=_fresh, args=(nxt.port, out)))
    procs[1].start()
    got = {g[0]: g[1:] for g in (out.get(timeout=120) for _ in range(2))}
    for p in procs:
        p.join(timeout=60)
    assert len(got["survivor"]) == 2 and got["survivor"][1].endswith("Error"), got  # its first start-up failed
    for who in ("survivor", "fresh"):
        assert isinstance(got[who][0], float), got  # both joined the next world and trained its step
