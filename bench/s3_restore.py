"""Restore throughput from S3 against the connections one piece is read over, through a bandwidth cap per
connection.

    python bench/s3_restore.py [--piece-mib 32] [--mb-per-conn 4] [--delay-ms 20] [--repeats 5]
                               [--connections 1,2,4,8,16] [--json]

One TCP stream to S3 is bounded (on the order of 100 MB/s on AWS: its S3 performance guidelines advise many
concurrent connections and byte-range GETs for throughput), while a node's NIC carries 12.5-50 GB/s; so a restore
that reads each piece over one GET is bound by that one stream. Here moto's server stands behind the drills' fault
proxy (orchestrator/drills/s3_proxy.py), which carries each connection's bodies at most `--mb-per-conn` MB/s and
holds each request `--delay-ms` (a far bucket's first byte), and `S3Checkpoints.read_piece` reads one piece of
`--piece-mib` MiB (a safetensors object, checked against its SHA256 as every restore does) with `connections` set
to each of `--connections` (ranged GETs of `part_bytes`, piece size / 16 here, at most that many at once). Prints
the median read time over `--repeats` per setting, its throughput, and its ratio to one connection. Progress on
stderr, the table on stdout.

The ratio, not the absolute figure, is what carries to AWS: on this machine the cap stands for S3's per-stream
bound. The recovery simulator's S3 bandwidth per node (drills/recovery_model.py `s3_gb_s`) is that per-stream
bound times the connections a restore opens, times the efficiency measured here, capped by the NIC.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--piece-mib", type=float, default=32.0)
    ap.add_argument("--mb-per-conn", type=float, default=4.0, help="each connection's cap, MB/s")
    ap.add_argument("--delay-ms", type=float, default=20.0, help="each request's first-byte delay")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--connections", default="1,2,4,8,16")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from orchestrator.drills.s3_proxy import S3FaultProxy
    from orchestrator.state.s3_store import S3Checkpoints
    from tests.moto_s3 import CREDS, use_test_credentials

    use_test_credentials()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=url, **CREDS).create_bucket(Bucket="restore")
    proxy = S3FaultProxy(url)
    try:
        rows = int(args.piece_mib * 2**20 / 4 / 3 / 1024)  # three fp32 tensors of rows x 1024
        writer = S3Checkpoints("s3://restore/bench", url)
        g = torch.Generator().manual_seed(0)
        state = {"w": {k: torch.randn(rows, 1024, generator=g) for k in ("param", "exp_avg", "exp_avg_sq")}}
        manifest = writer.save(1, state, 1.0, {"job": "bench", "run_id": "b1"})
        entry = manifest["units"]["w"]["pieces"][0]
        size = entry["bytes"]
        say(f"piece: {size / 2**20:.1f} MiB; cap {args.mb_per_conn:g} MB/s per connection, {args.delay_ms:g} ms "
            f"per request")
        proxy.conn_bytes_per_s = args.mb_per_conn * 1e6
        proxy.delay_s = args.delay_ms / 1e3
        out = []
        for n in [int(x) for x in args.connections.split(",")]:
            store = S3Checkpoints("s3://restore/bench", proxy.url, connections=n,
                                  part_bytes=max(1 << 20, -(-size // 16)))
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                _, nbytes = store.read_piece(1, store.manifest(1)["units"]["w"]["pieces"][0])
                times.append(time.perf_counter() - t0)
                say(f"  {n:2d} connection(s), repeat {r + 1}: {times[-1]:.2f} s")
            med = statistics.median(times)
            out.append({"connections": n, "median_s": med, "mb_s": nbytes / med / 1e6})
        base = out[0]["mb_s"]
        for row in out:
            row["vs_one"] = row["mb_s"] / base
    finally:
        proxy.stop()
        server.stop()
    if args.json:
        print(json.dumps({"piece_bytes": size, "mb_per_conn": args.mb_per_conn, "delay_ms": args.delay_ms,
                          "rows": out}, indent=2))
        return
    print(f"{'connections':>11} {'median s':>9} {'MB/s':>7} {'x one':>6}")
    for row in out:
        print(f"{row['connections']:>11} {row['median_s']:>9.2f} {row['mb_s']:>7.1f} {row['vs_one']:>6.1f}")


if __name__ == "__main__":
    main()
