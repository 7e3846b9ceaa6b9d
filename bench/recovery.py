"""Recovery on the local Ray test cluster: detection, re-plan, restore by tier, and a notice-driven drain.

    python bench/recovery.py [--trials 5]

Cluster: an L4 node (2 fake GPUs) that stays, and per trial a fresh H100 node
that the job uses and the bench removes (a hard kill: `remove_node`). The
embedded cluster's head has tuned health checks (orchestrator/cluster/embedded.py).
Per trial, from the kill: time until the controller sees the failure
(detection), has a new plan, has restored state, and has committed the first
new step. Then, in the same run, the same state restored from the controller's
memory tier and from S3 only (moto's threaded server on 127.0.0.1). Last, an
AWS spot notice through the fake metadata service with a 20 s deadline:
notice to drained (the doomed node's state is out) against the deadline.
Medians; these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import boto3  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.controller import State  # noqa: E402
from orchestrator.controller_actor import make_controller  # noqa: E402
from orchestrator.job_spec import parse_job  # noqa: E402
from orchestrator.preemption.metadata_server import FakeMetadataServer  # noqa: E402
from orchestrator.preemption.ray_notices import LABEL_METADATA_URL  # noqa: E402
from orchestrator.state.s3_store import S3Checkpoints  # noqa: E402
from planner import ClusterSpec, NodeSpec  # noqa: E402

STAY = NodeSpec(name="l4-0", gpu_type="L4", num_gpus=2, inter_node_bw_gb_s=100)


def job(doomed: NodeSpec, **runtime):
    return parse_job({"model": {"preset": "small"}, "train": {"global_batch": 16, "lr": 0.003, "precision": "fp32"},
                      "cluster": ClusterSpec(nodes=[doomed, STAY]).model_dump(),
                      "runtime": {"emulate_speed": False, "snapshot_every": 1} | runtime, "steps": 100})


def until(c, pred) -> float:
    while not pred(c):
        c.step()
    return time.perf_counter()


def kill_trial(ec: EmbeddedCluster, i: int) -> dict:
    doomed = NodeSpec(name=f"h100-{i}", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed)
    c = make_controller(job(doomed), steps=100)
    until(c, lambda c: c.progress.committed >= 2)
    committed = c.progress.committed
    t0 = time.perf_counter()
    ec.remove(doomed.name)
    t_detect = until(c, lambda c: c.state == State.RECOVERING)
    t_plan = until(c, lambda c: c.state == State.LAUNCHING)
    t_restored = until(c, lambda c: c.state == State.TRAINING)
    t_step = until(c, lambda c: c.progress.committed > committed)
    restore = next(e for e in reversed(c.progress.events) if e["kind"] == "restore")
    c.group.shutdown()
    return {"detect_s": t_detect - t0, "plan_s": t_plan - t0, "restored_s": t_restored - t0,
            "first_step_s": t_step - t0, "lost_steps": committed - c.progress.committed + 1,
            "bytes": restore["bytes"], "tier": restore["tier"]}


def tier_restore(ec: EmbeddedCluster, endpoint: str) -> dict:
    """The same state restored into the same plan from the memory tier, then from S3 only."""
    doomed = NodeSpec(name="h100-tiers", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed)
    j = parse_job(job(doomed).model_dump() | {"checkpoint": {"uri": "s3://bench/tiers", "endpoint_url": endpoint,
                                                            "s3_every": 1}})
    c = make_controller(j, steps=100)
    until(c, lambda c: c.progress.committed >= 2)
    c.store.flush()
    out = {}
    for tier in ("memory", "s3"):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            if tier == "memory":
                step, state, opt = c.store.memory.latest()
            else:
                step, state, opt, nbytes = S3Checkpoints(j.checkpoint.uri, endpoint).load_latest()
            c.group.import_state(state, opt)
            times.append(time.perf_counter() - t0)
        out[tier] = statistics.median(times)
    out["bytes"] = nbytes
    c.group.shutdown()
    ec.remove(doomed.name)
    return out


def drain_trial(ec: EmbeddedCluster, deadline_s: float = 20.0) -> dict:
    imds = FakeMetadataServer().start()
    doomed = NodeSpec(name="h100-notice", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed, labels={LABEL_METADATA_URL: imds.url})
    c = make_controller(job(doomed, notices="aws", notice_poll_s=0.2, snapshot_every=1000), steps=100)
    until(c, lambda c: c.progress.committed >= 2)
    imds.aws_spot(datetime.now(timezone.utc) + timedelta(seconds=deadline_s))
    until(c, lambda c: any(e["kind"] == "drain" and "first_step_s" in e for e in c.progress.events))
    d = next(e for e in c.progress.events if e["kind"] == "drain")
    c.group.shutdown()
    ec.remove(doomed.name)
    imds.stop()
    return {"deadline_s": d["deadline_s"] - d["notice_s"], "drained_s": d["snapshot_s"] - d["notice_s"],
            "first_step_s": d["first_step_s"] - d["notice_s"], "lost_steps": c.progress.restarts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import os

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    ec = EmbeddedCluster(ClusterSpec(nodes=[STAY]))
    ec.connect()
    try:
        trials = [kill_trial(ec, i) for i in range(args.trials)]
        print("| kill trial | detect s | new plan s | restored s | first new step s | lost steps | restored from |")
        print("|---|---|---|---|---|---|---|")
        for i, t in enumerate(trials):
            print(f"| {i} | {t['detect_s']:.2f} | {t['plan_s']:.2f} | {t['restored_s']:.2f} | {t['first_step_s']:.2f} "
                  f"| {t['lost_steps']} | {t['tier']} ({t['bytes'] / 2**20:.1f} MiB) |")
        for k in ("detect_s", "plan_s", "restored_s", "first_step_s"):
            print(f"median {k}: {statistics.median(t[k] for t in trials):.2f}")
        tiers = tier_restore(ec, endpoint)
        print(f"restore of the same state ({tiers['bytes'] / 2**20:.1f} MiB), median of 5: memory tier "
              f"{tiers['memory']:.3f} s, S3 only {tiers['s3']:.3f} s, S3-only / memory = {tiers['s3'] / tiers['memory']:.1f}x")
        d = drain_trial(ec)
        print(f"AWS notice, deadline {d['deadline_s']:.1f} s: drained after {d['drained_s']:.2f} s, first step without "
              f"the node after {d['first_step_s']:.2f} s, re-plans after failures {d['lost_steps']}")
    finally:
        ec.shutdown()
        server.stop()


if __name__ == "__main__":
    main()
