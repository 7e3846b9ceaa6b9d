"""Recovery on the local Ray test cluster: in place against restart, restore by tier, and a notice-driven drain.

    python bench/recovery.py [--trials 5] [--reshard-trials 3]

Cluster: an L4 node (2 fake GPUs) that stays, and per trial a fresh H100 node
that the bench removes (a hard kill: `remove_node`); the kill trials run two
data-parallel replicas, one on each node, so the L4's survivor holds every layer. The
embedded cluster's head has tuned health checks (orchestrator/cluster/embedded.py).
Per trial, from the kill: time until the controller sees the failure
(detection), has a new plan, has restored state, and has committed the first
new step, and the restore's bytes by tier; trials alternate between in-place
recovery (survivors keep their processes) and the restart path. The re-shard trials do the same for a
loss that changes the layout (a TP-2 stage and two PP stages; the last stage's node goes, and the plan on
what is left splits the layers anew). Then, in the same run, after a real
node loss, the same state restored into the same new plan by the restore
planner (survivors' live state, peer memory) with the moments overlapped (the weights
before training resumes, AdamW's moments beside the first step: also timed until they
are in) and with every byte first, and from S3 only (moto's threaded server on
127.0.0.1), in turn, for the small preset and a larger model. Then an H100 node joins an L4 job
(`--join-trials` times on each path): the move onto it, its tokens/s, and the training stall at the switch
(in place the joined GPU is warmed at the join and the switch waits for it). Last, an
AWS spot notice through the fake metadata service with a 20 s deadline, on each path:
notice to drained (the doomed node's state is out) against the deadline, and the training stall at the
switch (in place, the next plan is pre-staged while the doomed node trains).
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
import ray  # noqa: E402
from moto.server import ThreadedMotoServer  # noqa: E402

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.control.controller import State  # noqa: E402
from orchestrator.job_spec import parse_job  # noqa: E402
from orchestrator.preemption.metadata_server import FakeMetadataServer  # noqa: E402
from orchestrator.preemption.ray_notices import LABEL_METADATA_URL  # noqa: E402
from orchestrator.runtime.controller_actor import make_controller  # noqa: E402
from planner import ClusterSpec, NodeSpec, Pipeline, Plan, Stage  # noqa: E402

STAY = NodeSpec(name="l4-0", gpu_type="L4", num_gpus=2, inter_node_bw_gb_s=100)


def job(doomed: NodeSpec, **runtime):
    return parse_job({"model": {"preset": "small"}, "train": {"global_batch": 16, "lr": 0.003, "precision": "fp32"},
                      "cluster": ClusterSpec(nodes=[doomed, STAY]).model_dump(),
                      "runtime": {"emulate_speed": False, "snapshot_every": 1} | runtime, "steps": 100})


def until(c, pred) -> float:
    while not pred(c):
        c.step()
    return time.perf_counter()


def kill_trial(ec: EmbeddedCluster, i: int, recovery: str) -> dict:
    doomed = NodeSpec(name=f"h100-{recovery}-{i}", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed)
    # the job sees one of the L4's GPUs: the re-plan runs on the survivor alone (a second GPU would start a process)
    j = job(doomed, recovery=recovery)
    j = j.model_copy(update={"cluster": ClusterSpec(nodes=[doomed, STAY.model_copy(update={"num_gpus": 1})])})
    c = make_controller(j, steps=100, first_plan=dp_plan(j, [doomed.name, STAY.name]))  # the L4 holds every layer too
    return timed_kill(ec, c, [doomed.name]) | {"recovery": recovery}


def reshard_trial(ec: EmbeddedCluster, i: int, recovery: str) -> dict:
    """A layout change: a TP-2 first stage on an A100 node, then one L4 stage each on two nodes; the last L4 node
    is killed, and the re-plan on what is left splits the layers anew (another PP split, another TP degree)."""
    m1 = NodeSpec(name=f"rs-a100-{recovery}-{i}", gpu_type="A100-80GB", num_gpus=2, inter_node_bw_gb_s=100)
    m2, m3 = (NodeSpec(name=f"rs-l4{k}-{recovery}-{i}", gpu_type="L4", num_gpus=1, inter_node_bw_gb_s=100)
              for k in (2, 3))
    for n in (m1, m2, m3):
        ec.nodes[n.name] = ec.add(n)
    j = parse_job({"model": {"preset": "small"}, "train": {"global_batch": 16, "lr": 0.003, "precision": "fp32"},
                   "cluster": ClusterSpec(nodes=[m1, m2, m3]).model_dump(), "steps": 100,
                   "runtime": {"emulate_speed": False, "snapshot_every": 1, "recovery": recovery}})
    layers = j.model_spec.num_layers

    def st(a, b, n, tp=1):
        return Stage(layer_start=a, layer_end=b, gpu_type=n.gpu_type, node=n.name,
                     devices=[f"{n.name}/{k}" for k in range(tp)])
    plan = Plan(model_name=j.model_spec.name, num_layers=layers, global_batch=16, pipelines=[Pipeline(
        num_samples=16, micro_batch_size=8, num_micro_batches=2,
        stages=[st(0, layers // 2, m1, 2), st(layers // 2, layers - 1, m2), st(layers - 1, layers, m3)])])
    c = make_controller(j, steps=100, first_plan=plan)
    try:
        got = timed_kill(ec, c, [m3.name])
        layout = [(s.layer_start, s.layer_end, s.tp) for p in c.plan.pipelines for s in p.stages]
        return got | {"recovery": recovery, "layout": layout}
    finally:
        for n in (m1.name, m2.name):
            ec.remove(n)


def timed_kill(ec: EmbeddedCluster, c, doomed: list[str]) -> dict:
    """Train to step 2 (its peer copies in), hard-kill the `doomed` nodes, and time the recovery from the kill; the
    group ends after."""
    until(c, lambda c: c.progress.committed >= 2)
    committed = c.progress.committed
    step, receipts = c.store._receipts[-1]  # the newest snapshot's copies to peer keepers are in
    assert step == committed
    ray.get(receipts, timeout=60)
    survivors = {pid for pid, r in zip(c.group.pids, c.group.run.ranks, strict=True) if r.node not in doomed}
    t0 = time.perf_counter()
    for n in doomed:
        ec.remove(n)
    t_detect = until(c, lambda c: c.state == State.RECOVERING)
    t_plan = until(c, lambda c: c.state == State.LAUNCHING)
    t_restored = until(c, lambda c: c.state == State.TRAINING)
    t_step = until(c, lambda c: c.progress.committed > committed)
    restore = next(e for e in reversed(c.progress.events) if e["kind"] == "restore")
    kept = len(survivors & set(c.group.pids))
    c.group.shutdown()
    return {"detect_s": t_detect - t0, "plan_s": t_plan - t0, "restored_s": t_restored - t0,
            "restore_only_s": restore["restore_s"],
            "first_step_s": t_step - t0, "lost_steps": committed - restore["step"],
            "tiers": fmt_tiers(restore["bytes_by_tier"]), "in_place": restore.get("in_place_bytes", 0),
            "kept": f"{kept} of {len(survivors)}"}


def dp_plan(j, nodes: list[str]) -> Plan:
    """One replica of the whole model per node, on each node's first GPU (sample shares equal, up to one)."""
    b, m = j.train.global_batch, j.model_spec
    shares = [b // len(nodes) + (i < b % len(nodes)) for i in range(len(nodes))]
    gpu = {n.name: n.gpu_type for n in j.cluster.nodes}
    return Plan(model_name=m.name, num_layers=m.num_layers, global_batch=b, pipelines=[Pipeline(
        num_samples=k, micro_batch_size=k, num_micro_batches=1, stages=[Stage(
            layer_start=0, layer_end=m.num_layers, gpu_type=gpu[n], node=n, devices=[f"{n}/0"])])
        for n, k in zip(nodes, shares, strict=True)])


def fmt_tiers(by_tier: dict) -> str:
    return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in by_tier.items() if v) or "nothing"


def tier_restore(ec: EmbeddedCluster, endpoint: str, hidden: int | None, repeats: int = 5) -> dict:
    """After a real node loss, the same state restored into the same new plan, alternately by hetspot's
    restore planner (survivors' live state and peer memory first) and from S3 only (--restore-from s3)."""
    doomed = NodeSpec(name=f"h100-tiers-{hidden}", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed)
    model = {"preset": "small"} if hidden is None else {
        "name": f"bench-{hidden}", "num_layers": 6, "hidden_size": hidden, "num_heads": 8, "vocab_size": 256,
        "seq_len": 64}
    j = parse_job(job(doomed, recovery="restart").model_dump() | {"model": model, "checkpoint": {  # new processes
        "uri": f"s3://bench/tiers-{hidden}", "endpoint_url": endpoint, "s3_every": 1}})
    c = make_controller(j, steps=100)
    until(c, lambda c: c.progress.committed >= 2)
    c.store.flush()
    ec.remove(doomed.name)
    until(c, lambda c: c.state == State.TRAINING and c.progress.restarts == 1)
    first = next(e for e in reversed(c.progress.events) if e["kind"] == "restore")
    ways = {"nearest": ("nearest", True), "all-first": ("nearest", False), "s3": ("s3", False)}
    times: dict[str, list[float]] = {k: [] for k in [*ways, "moments-in"]}
    by_tier: dict[str, dict] = {}
    for _ in range(repeats):
        for way, (source, overlap) in ways.items():
            c.store.salvage(c.group)  # the workers' state becomes survivors' live state again
            c.store.restore_from, c.store.overlap = source, overlap
            r = c.store.restore(c.group)
            t = time.perf_counter()
            c.group.settle_restore()  # the overlapped moments: in this long after the restore returned
            times[way].append(r.restore_s)
            if overlap:
                times["moments-in"].append(r.restore_s + time.perf_counter() - t)
            by_tier[way] = r.bytes_by_tier
    c.group.shutdown()
    return {"first": first, "by_tier": by_tier, "model": model.get("name", "small")} | {
        f"{k}_s": statistics.median(v) for k, v in times.items()}


def drain_trial(ec: EmbeddedCluster, recovery: str, deadline_s: float = 20.0) -> dict:
    imds = FakeMetadataServer().start()
    doomed = NodeSpec(name=f"h100-notice-{recovery}", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    ec.nodes[doomed.name] = ec.add(doomed, labels={LABEL_METADATA_URL: imds.url})
    c = make_controller(job(doomed, notices="aws", notice_poll_s=0.2, snapshot_every=1000, recovery=recovery),
                        steps=100)
    until(c, lambda c: c.progress.committed >= 2)
    imds.aws_spot(datetime.now(timezone.utc) + timedelta(seconds=deadline_s))
    until(c, lambda c: any(e["kind"] == "drain" and "first_step_s" in e for e in c.progress.events))
    d = next(e for e in c.progress.events if e["kind"] == "drain")
    c.group.shutdown()
    ec.remove(doomed.name)
    imds.stop()
    return {"recovery": recovery, "deadline_s": d["deadline_s"] - d["notice_s"],
            "drained_s": d["snapshot_s"] - d["notice_s"], "first_step_s": d["first_step_s"] - d["notice_s"],
            "stall_s": d["stall_s"], "staged": "staged_s" in d, "lost_steps": c.progress.restarts}


def scale_up_trial(ec: EmbeddedCluster, recovery: str = "in-place", k: int = 0) -> dict:
    """An L4-only job; an H100 node (declared) joins after step 4; tokens/s before and after the move, and what
    training lost at the switch. In place the joined GPU gets a warm worker at the join and the move waits for it
    (training goes on); on the restart path the switch starts every process."""
    fast = NodeSpec(name=f"h100-join-{recovery}-{k}", gpu_type="H100-SXM", num_gpus=1, inter_node_bw_gb_s=100)
    base = job(fast, recovery=recovery)
    j = parse_job(base.model_dump() | {"runtime": base.runtime.model_dump() | {
        "emulate_speed": True, "scale_check_every": 1}})
    c = make_controller(j, steps=100000)
    until(c, lambda c: c.progress.committed >= 4)
    ec.nodes[fast.name] = ec.add(fast)
    t0 = time.perf_counter()
    until(c, lambda c: any(e["kind"] == "scale-up" and "first_step_s" in e for e in c.progress.events))
    moved_s = time.perf_counter() - t0
    at = c.progress.committed
    until(c, lambda c: c.progress.committed >= at + 5)
    c.group.shutdown()
    ec.remove(fast.name)
    tokens = j.train.global_batch * j.model_spec.seq_len
    before = statistics.median(c.progress.step_time_s[s] for s in range(1, 5))
    after = statistics.median(c.progress.step_time_s[s] for s in range(at + 1, at + 6))
    up = next(e for e in c.progress.events if e["kind"] == "scale-up")
    chosen = min(up["finish_s"], key=up["finish_s"].get)
    # what the switch cost the job (`stall_s`: from the switch to ready to step, the re-form and the restore)
    predicted = {"running": up["predicted_tokens_per_s"]["running"], "new": up["predicted_tokens_per_s"][chosen]}
    return {"recovery": recovery, "before": tokens / before, "after": tokens / after, "moved_s": moved_s,
            "stall_s": up["stall_s"], "lost": c.progress.restarts, "predicted": predicted,
            "candidates": len(up["finish_s"]) - 1}


def print_trials(title: str, trials: list[dict]) -> None:
    if not trials:
        return
    print(f"\n| {title} | recovery | survivors' processes kept | detect s | new plan s | restored s (restore "
          "alone) | first new step s | lost steps | moved | read in place MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, t in enumerate(trials):
        print(f"| {i // 2} | {t['recovery']} | {t['kept']} | {t['detect_s']:.2f} | {t['plan_s']:.2f} "
              f"| {t['restored_s']:.2f} ({t['restore_only_s']:.2f}) | {t['first_step_s']:.2f} | {t['lost_steps']} "
              f"| {t['tiers']} | {t['in_place'] / 2**20:.1f} |")
    for path in ("in-place", "restart"):
        got = [t for t in trials if t["recovery"] == path]
        print(f"median, {path}: " + ", ".join(f"{k} {statistics.median(t[k] for t in got):.2f}"
                                             for k in ("detect_s", "plan_s", "restored_s", "first_step_s")))
    med = {p: statistics.median(t["first_step_s"] for t in trials if t["recovery"] == p)
           for p in ("in-place", "restart")}
    print(f"kill -> first new step: in place {med['in-place']:.2f} s, restart {med['restart']:.2f} s "
          f"({med['restart'] / med['in-place']:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--reshard-trials", type=int, default=3, help="layout-change kill trials per recovery path")
    ap.add_argument("--join-trials", type=int, default=5, help="scale-up (a node joins) trials per recovery path")
    ap.add_argument("--big-hidden", type=int, default=384,
                    help="hidden size of the larger model of the tier comparison")
    ap.add_argument("--only-tiers", action="store_true", help="only the tier comparison (no kill, scale-up or notice)")
    ap.add_argument("--only-joins", action="store_true", help="only the scale-up trials (a node joins)")
    ap.add_argument("-v", action="store_true", help="show moto's request log, Ray's echo of the injected failures "
                    "and hetspot's recovery warnings")
    args = ap.parse_args()
    from bench.quiet import quiet

    quiet(args.v)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import os

    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    ec = EmbeddedCluster(ClusterSpec(nodes=[STAY]), object_store_mb=1024)  # room for the larger model's copies
    ec.connect()
    try:
        if args.only_joins:
            args.trials = args.reshard_trials = 0
        kills = [] if args.only_tiers else [kill_trial(ec, i, r) for i in range(args.trials)
                                            for r in ("in-place", "restart")]  # interleaved: same load for both
        print_trials("kill trial (DP: the L4 holds every layer)", kills)
        reshards = [] if args.only_tiers else [reshard_trial(ec, i, r) for i in range(args.reshard_trials)
                                               for r in ("in-place", "restart")]
        if reshards:
            print("\nlayouts after the loss:", sorted({str(t["layout"]) for t in reshards}))
        print_trials("re-shard trial (TP-2 + 2 PP stages, last stage lost)", reshards)
        if not args.only_joins:
            print("\n| model | state MiB | first recovery: restored from | hetspot restore s (tiers) | moments in by s "
                  "| every byte first s | S3-only restore s | S3-only / hetspot |")
            print("|---|---|---|---|---|---|---|---|")
        for hidden in () if args.only_joins else (None, args.big_hidden):
            t = tier_restore(ec, endpoint, hidden)
            near, s3 = t["by_tier"]["nearest"], t["by_tier"]["s3"]
            tiers = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in near.items() if v)
            print(f"| {t['model']} | {s3['s3'] / 2**20:.1f} | {fmt_tiers(t['first']['bytes_by_tier'])} "
                  f"| {t['nearest_s']:.3f} ({tiers} MiB) | {t['moments-in_s']:.3f} | {t['all-first_s']:.3f} "
                  f"| {t['s3_s']:.3f} | {t['s3_s'] / t['nearest_s']:.1f}x |")
        if args.only_tiers:
            return
        ups = [scale_up_trial(ec, recovery, k) for k in range(args.join_trials) for recovery in ("in-place", "restart")]
        print("\n| join trial | recovery | tokens/s before -> after | moved after the join s | stall at the switch s "
              "| steps lost |")
        print("|---|---|---|---|---|---|")
        for i, u in enumerate(ups):
            print(f"| {i // 2} | {u['recovery']} | {u['before']:,.0f} -> {u['after']:,.0f} | {u['moved_s']:.2f} "
                  f"| {u['stall_s']:.2f} | {u['lost']} |")
        u = ups[0]
        print(f"scale-up: an H100 joins an L4 job: {u['before']:,.0f} -> {u['after']:,.0f} tokens/s (measured, "
              f"emulated speeds; predicted {u['predicted']['running']:,} -> {u['predicted']['new']:,}, chosen among "
              f"{u['candidates']} candidate plans)")
        for recovery in ("in-place", "restart"):
            got = [u for u in ups if u["recovery"] == recovery]
            stall = statistics.median(u["stall_s"] for u in got)
            moved = statistics.median(u["moved_s"] for u in got)
            print(f"median of {len(got)} joins, {recovery}: stalled {stall:.2f} s at the switch, moved {moved:.2f} s "
                  f"after the join, steps lost {sum(u['lost'] for u in got)}")
        for recovery in () if args.only_joins else ("in-place", "restart"):
            d = drain_trial(ec, recovery)
            print(f"AWS notice, deadline {d['deadline_s']:.1f} s, {recovery}{' (pre-staged)' if d['staged'] else ''}: "
                  f"drained after {d['drained_s']:.2f} s, first step without the node after {d['first_step_s']:.2f} s,"
                  f" training stalled {d['stall_s']:.2f} s at the switch, re-plans after failures {d['lost_steps']}")
    finally:
        ec.shutdown()
        server.stop()


if __name__ == "__main__":
    main()
