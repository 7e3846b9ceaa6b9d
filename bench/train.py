"""Training throughput on the local Ray test cluster: hetspot vs symmetric vs Ray Train DDP vs one process.

    python bench/train.py [--steps 12] [--warmup 2]

The cluster is simulated: one A100-80GB node beside an L4 node (2 GPUs) and a
T4 node, all fake GPUs on this CPU machine. Device speed is emulated the same
way for every contender: after each unit of compute a worker on GPU type T
sleeps (slowdown - 1) x the compute time, slowdown = peak TFLOPS of the fastest
type in use / peak TFLOPS of T (catalog figures). So an L4 step takes about
2.6x and a T4 step about 4.8x an A100 step.

Contenders, same model (the `small` preset), same global batch, same data:
  hetspot     the planner's plan (asymmetric batch shares, pipelines)
  symmetric   planner.baselines.megatron_symmetric (even split over all GPUs)
  ray-train   ray.train.torch.TorchTrainer with DDP, one worker per GPU, even batch split
  single      one process on the fastest GPU, whole batch
Reported: median tokens/s over the steps after warm-up; hetspot's runtime (both plans) also with
`runtime.overlap_grad_sync: false` (each layer's all-reduce after the whole backward, not during it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import ray  # noqa: E402
import torch  # noqa: E402

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.job_spec import parse_job  # noqa: E402
from orchestrator.runtime.plan_run import PlanRun, slowdowns  # noqa: E402
from planner import ClusterSpec, NodeSpec, plan  # noqa: E402
from planner.baselines import megatron_symmetric  # noqa: E402
from planner.catalog import gpu_info  # noqa: E402
from planner.specs import tokens_per_step  # noqa: E402
from workers.data import SyntheticCorpus  # noqa: E402
from workers.model import Stage  # noqa: E402

CLUSTER = ClusterSpec(nodes=[
    NodeSpec(name="a100-0", gpu_type="A100-80GB", num_gpus=1, inter_node_bw_gb_s=100),
    NodeSpec(name="l4-0", gpu_type="L4", num_gpus=2, inter_node_bw_gb_s=100),
    NodeSpec(name="t4-0", gpu_type="T4", num_gpus=1, inter_node_bw_gb_s=100),
])
JOB = parse_job({"model": {"preset": "small"}, "train": {"global_batch": 64, "lr": 0.003, "precision": "fp32"},
                 "cluster": CLUSTER.model_dump(), "runtime": {"emulate_speed": True}})
FASTEST = max(gpu_info(n.gpu_type).peak_tflops for n in CLUSTER.nodes)


def _median_tok_s(step_times: list[float], warmup: int) -> float:
    return tokens_per_step(JOB.model_spec, JOB.train.global_batch) / statistics.median(step_times[warmup:])


def run_plan(p, steps: int, warmup: int, overlap: bool = True) -> float:
    job = JOB.model_copy(update={"runtime": JOB.runtime.model_copy(update={"overlap_grad_sync": overlap})})
    run = PlanRun(job, p)
    try:
        run.start()
        return _median_tok_s(run.run(steps).step_time_s, warmup)
    finally:
        run.shutdown()


def _ddp_loop(config: dict) -> None:
    """Ray Train worker: plain DDP on the full model, an even share of the batch."""
    import torch.distributed as dist
    from ray import train

    torch.set_num_threads(1)
    model_spec, steps = config["model"], config["steps"]
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node = ray.get_runtime_context().get_node_id()
    gpu_type = next(k.split(":", 1)[1] for n in ray.nodes() if n["NodeID"] == node
                    for k in n["Resources"] if k.startswith("accelerator_type:"))
    slow = FASTEST / gpu_info(gpu_type).peak_tflops
    module = Stage(model_spec, 0, model_spec.num_layers, True, True)
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, fused=True)
    data = SyntheticCorpus(model_spec.vocab_size, model_spec.seq_len)
    big_b = config["global_batch"]
    share = [big_b // world + (i < big_b % world) for i in range(world)]
    times = []
    for s in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        start = s * big_b + sum(share[:rank])
        tokens = data.batch(range(start, start + share[rank]))
        tc = time.perf_counter()
        loss = module.loss_sum(ddp(tokens[:, :-1]), tokens[:, 1:]) / big_b
        loss.backward()
        time.sleep((slow - 1) * (time.perf_counter() - tc))
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:  # Ray Train v2 keeps reported metrics only with checkpoints; all ranks share this disk
        Path(config["out"]).write_text(json.dumps(times))


def run_ray_train(steps: int, warmup: int) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(tempfile.mkdtemp()) / "ddp_step_times.json"

    trainer = TorchTrainer(
        _ddp_loop,
        train_loop_config={"model": JOB.model_spec, "steps": steps, "global_batch": JOB.train.global_batch,
                           "out": str(out)},
        scaling_config=ScalingConfig(num_workers=CLUSTER.num_gpus, use_gpu=True),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(Path("/tmp/hetspot-bench").resolve()), name="ddp"),
    )
    trainer.fit()
    return _median_tok_s(json.loads(out.read_text()), warmup)


def run_single(steps: int, warmup: int) -> float:
    torch.set_num_threads(1)
    m = JOB.model_spec
    module = Stage(m, 0, m.num_layers, True, True)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, fused=True)
    data, big_b = SyntheticCorpus(m.vocab_size, m.seq_len), JOB.train.global_batch
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        tokens = data.batch(range(s * big_b, (s + 1) * big_b))
        (module.loss_sum(module(tokens[:, :-1]), tokens[:, 1:]) / big_b).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return _median_tok_s(times, warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    hp = plan(CLUSTER, JOB.model_spec, JOB.train)
    sym = megatron_symmetric(CLUSTER, JOB.model_spec, JOB.train)
    rows = {"single (A100 speed)": run_single(args.steps, args.warmup)}
    ec = EmbeddedCluster(CLUSTER)
    try:
        ec.connect()
        rows["hetspot plan"] = run_plan(hp, args.steps, args.warmup)
        rows["hetspot plan, gradient sync after backward"] = run_plan(hp, args.steps, args.warmup, overlap=False)
        rows["megatron-symmetric"] = run_plan(sym, args.steps, args.warmup)
        rows["megatron-symmetric, gradient sync after backward"] = run_plan(sym, args.steps, args.warmup, overlap=False)
        try:
            rows["ray-train TorchTrainer DDP"] = run_ray_train(args.steps, args.warmup)
        except ImportError as e:  # the `bench` extra: pip install -e '.[bench]'
            print(f"Ray Train row skipped: {e}")
    finally:
        ec.shutdown()

    def describe(p):
        return "; ".join(f"{x.num_samples} samples on " + "+".join(f"{s.tp}x{s.gpu_type}[{s.layer_start}:{s.layer_end}]"
                                                                   for s in x.stages) for x in p.pipelines)

    print(f"slowdowns: {slowdowns(hp, True)[0] | slowdowns(sym, True)[0]}")
    print(f"hetspot plan: {describe(hp)}")
    print(f"symmetric plan: {describe(sym)}\n")
    print("| contender | tokens/s (median) | vs hetspot |")
    print("|---|---|---|")
    for name, tok in rows.items():
        print(f"| {name} | {tok:,.0f} | {tok / rows['hetspot plan']:.2f}x |")


if __name__ == "__main__":
    main()
