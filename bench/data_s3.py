"""Training data in S3 against the same data in a local file: the step time of one job, on the local Ray test
cluster, with every S3 request held 20 ms (a far bucket's first-byte latency) by the drills' fault proxy.

    python bench/data_s3.py [--trials 5] [--steps 12] [--delay-ms 20] [--cache-gb 4] [--block-mib 1] [--json]

The job: the `small` preset, a global batch of 32 in micro-batches of 8, as a 2-stage pipeline beside a
data-parallel replica on three fake-GPU nodes (so a first, a middle-free last, and a whole-model stage read
data); tokens from a 4M-token uint16 file. Each trial trains the job from a local file and from S3 (moto's server
behind the proxy), alternating; a trial's figure is the median step time after the first two steps (warm-up).
The S3 reads run ahead of each step (workers/data.py ReadAhead: this step's micro-batches and the next's, each
window on its own thread), so the forward should never wait on S3, and through the node's block cache
(workers/s3_data.py BlockCache; `--cache-gb 0` turns it off), which starts empty in every trial (a fresh folder).
Prints medians over the trials, their ratio, and the GETs the proxy saw. Progress on stderr, the table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import numpy as np  # noqa: E402

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.control.controller import State  # noqa: E402
from orchestrator.job_spec import parse_job  # noqa: E402
from orchestrator.runtime.controller_actor import make_controller  # noqa: E402
from planner import ClusterSpec, NodeSpec, Pipeline, Plan, Stage  # noqa: E402

NODES = [NodeSpec(name=f"d{i}", gpu_type="A100-80GB", num_gpus=1, inter_node_bw_gb_s=100) for i in range(3)]


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plan() -> Plan:
    def st(a, b, n):
        return Stage(layer_start=a, layer_end=b, gpu_type="A100-80GB", node=n.name, devices=[f"{n.name}/0"])
    return Plan(model_name="small", num_layers=6, global_batch=32, pipelines=[
        Pipeline(num_samples=16, micro_batch_size=8, num_micro_batches=2, stages=[st(0, 3, NODES[0]),
                                                                                 st(3, 6, NODES[1])]),
        Pipeline(num_samples=16, micro_batch_size=8, num_micro_batches=2, stages=[st(0, 6, NODES[2])])])


def job(path: str, endpoint: str | None, steps: int, cache: dict | None = None):
    data = ({"kind": "tokens", "path": path, "dtype": "uint16"} | ({"endpoint_url": endpoint} if endpoint else {})
            | (cache or {}))
    return parse_job({"name": "data-bench", "model": {"preset": "small"},
                      "train": {"global_batch": 32, "lr": 0.003, "precision": "fp32"},
                      "cluster": ClusterSpec(nodes=NODES).model_dump(), "data": data,
                      "runtime": {"emulate_speed": False, "snapshot_every": 1000, "scale_check_every": 0},
                      "steps": steps})


def step_time(j, steps: int) -> float:
    c = make_controller(j, steps, first_plan=plan())
    if c.run() != State.DONE:
        raise RuntimeError(f"the job failed: {c.error}")
    times = [c.progress.step_time_s[s] for s in range(2, steps)]
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--cache-gb", type=float, default=4.0, help="data.cache_gb (0: one GET per window)")
    ap.add_argument("--block-mib", type=float, default=1.0, help="data.block_mib")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-v", action="store_true", help="show moto's request log and Ray's worker output")
    args = ap.parse_args()
    from bench.quiet import quiet

    quiet(args.v)
    import boto3
    from moto.server import ThreadedMotoServer

    from orchestrator.drills.s3_proxy import S3FaultProxy
    from tests.moto_s3 import CREDS, use_test_credentials

    use_test_credentials()
    tmp = Path(tempfile.mkdtemp(prefix="hetspot-data-bench-"))
    local = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 4_000_000, dtype=np.uint16).tofile(local)  # the preset's vocabulary
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    s3 = boto3.client("s3", endpoint_url=f"http://{host}:{port}", **CREDS)
    s3.create_bucket(Bucket="data")
    s3.put_object(Bucket="data", Key="tokens.bin", Body=local.read_bytes())
    proxy = S3FaultProxy(f"http://{host}:{port}")
    proxy.delay_s = args.delay_ms / 1000
    ec = EmbeddedCluster(ClusterSpec(nodes=NODES))
    ec.connect()
    got: dict[str, list[float]] = {"local": [], "s3": []}
    gets: list[int] = []
    try:
        for t in range(args.trials):
            cache = {"cache_gb": args.cache_gb, "block_mib": args.block_mib, "cache_dir": str(tmp / f"cache-{t}")}
            for source, path, endpoint in (("local", str(local), None), ("s3", "s3://data/tokens.bin", proxy.url)):
                before = proxy.counts["received"]
                got[source].append(step_time(job(path, endpoint, args.steps, cache), args.steps))
                if source == "s3":
                    gets.append(proxy.counts["received"] - before)
                say(f"trial {t + 1}/{args.trials} {source}: median step {got[source][-1] * 1000:.1f} ms"
                    + (f", {gets[-1]} S3 requests" if source == "s3" else ""))
    finally:
        ec.shutdown()
        proxy.stop()
        server.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    out = {"delay_ms": args.delay_ms, "trials": args.trials, "steps": args.steps,
           "median_step_s": med, "ratio_s3_over_local": med["s3"] / med["local"], "per_trial_s": got,
           "cache_gb": args.cache_gb, "block_mib": args.block_mib,
           "s3_requests_per_trial": gets, "file_bytes": local.stat().st_size}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"step time, medians of {args.trials} trials ({args.steps} steps each, the first 2 left out), "
              f"S3 requests held {args.delay_ms:.0f} ms:")
        print(f"  local file  {med['local'] * 1000:8.1f} ms")
        print(f"  S3          {med['s3'] * 1000:8.1f} ms   ({out['ratio_s3_over_local']:.3f}x local)")
        print(f"  S3 requests a trial (a job of {args.steps} steps, the cache "
              f"{'off' if args.cache_gb <= 0 else f'{args.cache_gb * 1024:g} MiB in {args.block_mib:g} MiB blocks'}): "
              f"median {statistics.median(gets):.0f} (the file: {out['file_bytes']:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
