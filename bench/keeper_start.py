"""A node's keeper actor: seconds from its creation to its first answer, and its process's CPU and resident memory
once it holds a shard, on a local Ray cluster.

    python bench/keeper_start.py [--trials 5] [--shard-mib 3]

A keeper starts on every node of a job, and on every node a notice's pre-staged plan or a join brings in: the
drain waits for it (orchestrator/control/controller.py `_switch_now`), and what it holds lives in the host memory
its process leaves free. Each trial creates one keeper (orchestrator/state/keeper.py `Keeper`), times `ping`, hands
it one peer shard of `--shard-mib` MiB of float32 (`put`, as a worker's snapshot does), then reads its process's
CPU seconds and resident set from /proc and whether torch is in its modules; the keeper is killed before the
next. Printed: each trial, then the medians. These machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])


def process_figures() -> tuple[float, float, bool]:
    """(CPU seconds, resident MiB, torch imported) of the calling process."""
    stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return cpu, rss, "torch" in sys.modules


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--shard-mib", type=float, default=3.0, help="the peer shard handed to each keeper")
    a = ap.parse_args()
    import numpy as np
    import ray

    from orchestrator.cluster.embedded import EmbeddedCluster
    from orchestrator.state.keeper import Keeper
    from planner.specs import ClusterSpec
    from workers.transfer import Tier

    # the embedded test cluster (a head only), not ray.init(): Ray 2.60's ray.init() of a local cluster writes
    # ~/.ray/auth_token, which later `ray start` heads of this user then ask their clients for
    ec = EmbeddedCluster(ClusterSpec.model_construct(nodes=[]), head_cpus=2)
    ec.connect()
    rows = int(a.shard_mib * 2**20 / 4 / 1024 / 3) or 1
    w = np.ones((rows, 1024), np.float32)
    shard = {"w": {"param": w, "exp_avg": w, "exp_avg_sq": w, "slice": ((0, rows), (0, 1024)),
                   "shape": (rows, 1024), "optimizer_steps": 1.0}}
    out = []
    for i in range(a.trials):
        t0 = time.monotonic()
        k = Keeper.remote(f"bench-{i}")
        ray.get(k.ping.remote())
        ready = time.monotonic() - t0
        ray.get(k.put.remote(Tier.PEER, 1, 0, shard))
        cpu, rss, torch_in = ray.get(k.__ray_call__.remote(lambda self: process_figures()))
        out.append((ready, cpu, rss))
        print(f"trial {i + 1}: ready {ready:.2f} s, CPU {cpu:.2f} s, resident {rss:.0f} MiB, torch imported: "
              f"{torch_in}", file=sys.stderr)
        ray.kill(k)
        time.sleep(0.5)
    ready, cpu, rss = (statistics.median(r[j] for r in out) for j in range(3))
    print(f"keeper start, median of {a.trials}: ready {ready:.2f} s, CPU {cpu:.2f} s, resident {rss:.0f} MiB "
          f"holding a {a.shard_mib:g} MiB shard")
    ec.shutdown()


if __name__ == "__main__":
    main()
