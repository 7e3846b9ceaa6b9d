"""A survivor's memory over many in-place recoveries: does each aborted process group stay behind?

    python bench/survivor_memory.py [--recoveries 50] [--json]

Two ranks of the `tiny` preset in two data-parallel replicas (gloo, no Ray), as workers/actor.py runs them in
place: the survivor keeps its process across every recovery; its peer is a new process each time (forked from a
process that imported torch once) that joins, trains one step, and dies without closing anything. Each recovery
the survivor builds its stage anew (the engine a kept TrainWorker's `reconfigure` builds), joins a new group, trains
a step, is blocked in the next step's gradient sync by its dead peer, fails, aborts its groups
(Engine.abort_groups, as TrainWorker.abort does), keeps its committed step and closes the stage (workers/restore.py
`Kept.keep` and Engine.close, as `retain` does); the next stage loads the kept step from the process's own memory
(`Restore.load`, tier in_place) before it trains. The survivor's resident memory is read after each recovery; the
figure is the growth from the 5th recovery (imports and allocator pools settled) to the last, and the median
seconds a recovery took here. Progress on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec  # noqa: E402
from tests.net import free_port  # noqa: E402

MODEL = ModelSpec.preset("tiny")
TRAIN = TrainSpec(global_batch=8, lr=0.01, precision="fp32")


def _plan() -> Plan:
    def pipe(node):
        return Pipeline(num_samples=4, micro_batch_size=2, num_micro_batches=2, stages=[Stage(
            layer_start=0, layer_end=MODEL.num_layers, gpu_type="L4", node=node, devices=[f"{node}/0"])])
    return Plan(model_name="tiny", num_layers=MODEL.num_layers, global_batch=8, pipelines=[pipe("a"), pipe("b")])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _engine(rank: int):
    import torch

    from workers.data import make_dataset
    from workers.engine import Engine

    return Engine(_plan(), rank, MODEL, TRAIN, make_dataset("synthetic", MODEL.seq_len, MODEL.vocab_size, 0),
                  torch.float32)


def _survivor(ports: list[int], out) -> None:
    import torch

    from workers.restore import Kept, Restore
    from workers.state import local_region
    from workers.transfer import Fetch, KeptRequest

    torch.set_num_threads(1)
    rows = []
    kept = Kept()  # what this process keeps across plans (TrainWorker.kept)
    restore = Restore(kept, lambda answer, timeout=None: answer)
    for i, port in enumerate(ports):
        t0 = time.perf_counter()
        e = _engine(0)
        e.connect(f"tcp://127.0.0.1:{port}", 30)
        if kept.state is not None:  # the step it kept, loaded where it lies (tier in_place, nothing moved)
            step, shards = kept.state
            fetches = [Fetch(n, local_region(e, n), None, KeptRequest(n, local_region(e, n))) for n in sorted(shards)]
            opt = max(sh["optimizer_steps"] for sh in shards.values())
            restore.load(e, step, opt, fetches, None, overlap=False)
        s = e.committed_step + 1
        e.step(s)
        try:
            e.step(s + 1)  # its peer is gone: the gradient sync fails
            raise RuntimeError("the step after the peer died did not fail")
        except RuntimeError as err:
            if "did not fail" in str(err):
                raise
        e.abort_groups()
        kept.keep(e, None)  # as TrainWorker.retain: the committed step kept (the stage's own tensors), then closed
        e.close()
        del e
        rows.append((_rss(), time.perf_counter() - t0))
        print(f"recovery {i + 1}/{len(ports)}: {rows[-1][0] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    out.put(rows)


def _peer(port: int) -> None:
    e = _engine(1)
    e.connect(f"tcp://127.0.0.1:{port}", 30)
    e.step(0)
    os._exit(0)  # dies mid-job: nothing closed


def _peers(ports: list[int]) -> None:
    import torch

    import workers.engine  # noqa: F401  (imported once; each peer is a fork of this process)

    torch.set_num_threads(1)
    fork = mp.get_context("fork")
    for port in ports:
        p = fork.Process(target=_peer, args=(port,))
        p.start()
        p.join()


def run(recoveries: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = [free_port() for _ in range(recoveries)]
    procs = [ctx.Process(target=_survivor, args=(ports, out)), ctx.Process(target=_peers, args=(ports,))]
    for p in procs:
        p.start()
    rows = out.get(timeout=60 * recoveries)
    for p in procs:
        p.join(timeout=60)
    settled = min(4, len(rows) - 1)
    first, last = rows[settled][0], rows[-1][0]
    return {"recoveries": recoveries, "rss_mib_at": {settled + 1: round(first / 2**20, 1),
                                                    len(rows): round(last / 2**20, 1)},
            "growth_pct": round(100 * (last - first) / first, 2),
            "median_recovery_s": round(statistics.median(t for _, t in rows), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recoveries", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = run(args.recoveries)
    if args.json:
        print(json.dumps(r))
        return
    (a, ra), (b, rb) = r["rss_mib_at"].items()
    print(f"| recoveries | survivor RSS after recovery {a} | after recovery {b} | growth | median recovery s |")
    print("|---|---|---|---|---|")
    print(f"| {r['recoveries']} | {ra} MiB | {rb} MiB | {r['growth_pct']:+.2f}% | {r['median_recovery_s']:.3f} |")


if __name__ == "__main__":
    main()
