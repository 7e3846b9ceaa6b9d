"""`hetspot status` on jobs of 20 and of 2,000 committed steps: its time and what it reads.

    python bench/status.py [--repeats 7]

Each job's run record is written to moto's S3 server as a job writes it (orchestrator/runtime/run_record.py:
a re-plan at step 10, every step a row), then `hetspot status s3://.../runs/ID --json` runs in this process
`--repeats` times per job (after one untimed call). Printed: the median wall time, the bytes of record.json it
reads, and, for comparison, the bytes of the per-step history (what `--history` and `plot` read, and what a
status that parsed every step would). Medians; these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from typer.testing import CliRunner  # noqa: E402

from orchestrator.cli.main import app  # noqa: E402
from orchestrator.state.s3_store import new_client  # noqa: E402
from tests.moto_s3 import moto_s3, use_test_credentials  # noqa: E402
from tests.test_run_record import write_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    use_test_credentials()
    runner = CliRunner()
    print("| committed steps | status median s | record.json bytes read | per-step history bytes (not read) |")
    print("|---|---|---|---|")
    with moto_s3("bench") as url:
        client = new_client(url)
        out = {}
        for steps in (20, 2000):
            where = f"s3://bench/job-{steps}/runs/rec-1"
            write_run(where, steps, url)
            runner.invoke(app, ["status", where, "--endpoint-url", url, "--json"])  # warm-up: imports, first client
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                res = runner.invoke(app, ["status", where, "--endpoint-url", url, "--json"])
                times.append(time.perf_counter() - t0)
                assert res.exit_code == 0, res.output
            objs = client.list_objects_v2(Bucket="bench", Prefix=f"job-{steps}/runs/rec-1/")["Contents"]
            record = next(o["Size"] for o in objs if o["Key"].endswith("record.json"))
            history = sum(o["Size"] for o in objs if o["Key"].endswith(".jsonl"))
            out[steps] = statistics.median(times)
            print(f"| {steps:,} | {out[steps]:.3f} | {record:,} | {history:,} |")
    print(f"2,000 steps / 20 steps: {out[2000] / out[20]:.2f}x")


if __name__ == "__main__":
    main()
