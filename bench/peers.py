"""Recovery beside the peers a user would pick: hetspot, Ray Train 2.60 (elastic) and torchft 0.2.0, same kill.

    pip install -e '.[peers]'      # ray[train] and torchft: the bench's own extra
    python bench/peers.py [--kills 5] [--steps 8] [--kill-after 3]

One run on the embedded Ray cluster: three nodes of one fake L4 each, one data-parallel worker per node,
the `small` GPT in float64, global batch 12 (4 samples a worker), AdamW, the same synthetic data and seed.
Per system, `--kills` times: train, and once step `--kill-after` is committed, hard-kill one node
(`remove_node`: its raylet and every process on it go, as a reclaimed instance) and train on to `--steps`.

  hetspot     its controller (orchestrator/control/controller.py), recovery in place (the default) and
              the restart path, peer snapshots every step (runtime.snapshot_every: 1);
  Ray Train   `TorchTrainer` with elastic `ScalingConfig(num_workers=(2, 3))`, `FailureConfig(max_failures=-1)`,
              a checkpoint reported every step from rank 0 to `RunConfig(storage_path=...)` and the loop
              resumed from `ray.train.get_checkpoint()`, as docs.ray.io's "Handling Failures and Node
              Preemption" and "Elastic training" guides (Ray Train V2) set it up; storage is a local folder
              (every node of this cluster shares the disk); and again with its worker-group start timeout
              (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, default 60 s) at `--ray-train-timeout` (5 s), the knob
              that decides its recovery time when it re-forms before the cluster has declared the node dead;
  torchft     one replica group per node (a Ray actor), each with its `Manager` (min_replica_size 1,
              timeout 30 s), `ProcessGroupGloo(timeout=5 s)`, `PGTransport` for live recovery,
              `torchft.Optimizer`, gradients averaged by `Manager.allreduce` (what
              `torchft.DistributedDataParallel`'s hook does; the class fails once a peer dies in 0.2.0,
              see TorchftGroup.run), and one Lighthouse with the
              settings of torchft's README (`--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`),
              as pytorch/torchft's train_ddp.py does.

Per kill: seconds from the kill to the first step committed after it, committed steps lost or redone,
bytes read from storage to recover, and the oracle: every committed step's loss against an uninterrupted
run of the same system (relative 1e-9: float64, so only a different set of samples or a lost update
moves it). Then the case only hetspot runs: a TP-2 stage on an A100 node and two L4 pipeline stages, the
last L4 node killed, the plan on what is left another split of the layers; its losses are held to
hetspot's uninterrupted data-parallel run. Medians; these machines are shared and noisy (the load
average is printed with the table).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import ray  # noqa: E402
import torch  # noqa: E402

from orchestrator.cluster.embedded import EmbeddedCluster  # noqa: E402
from orchestrator.control.controller import State  # noqa: E402
from orchestrator.job_spec import parse_job  # noqa: E402
from orchestrator.runtime.controller_actor import make_controller  # noqa: E402
from planner import ClusterSpec, NodeSpec, Pipeline, Plan, Stage  # noqa: E402

RTOL = 1e-9
SYSTEMS = ("hetspot", "ray-train", "ray-train-tuned", "torchft")


class Setup:
    """What every system trains: model, batch, optimizer, data and dtype."""

    def __init__(self, preset: str = "small", global_batch: int = 12, lr: float = 3e-3, steps: int = 8,
                 kill_after: int = 3, workers: int = 3):
        self.preset, self.global_batch, self.lr, self.steps = preset, global_batch, lr, steps
        self.kill_after, self.workers = kill_after, workers
        self.job = parse_job({"model": {"preset": preset}, "train": {"global_batch": global_batch, "lr": lr,
                                                                     "precision": "fp32"},
                              "runtime": {"dtype": "float64", "emulate_speed": False, "snapshot_every": 1,
                                          "collective_timeout_s": 20}, "steps": steps})

    @property
    def model(self):
        return self.job.model_spec


def node(name: str, gpu: str = "L4", gpus: int = 1) -> NodeSpec:
    return NodeSpec(name=name, gpu_type=gpu, num_gpus=gpus, inter_node_bw_gb_s=100)


def oracle(losses: dict[int, float], ref: dict[int, float]) -> str:
    """'equal' when every committed step's loss is the uninterrupted run's; else the first step that is not."""
    steps = sorted(ref)
    if sorted(losses) != steps:
        return f"steps {sorted(set(steps) - set(losses))} missing"
    for s in steps:
        if abs(losses[s] - ref[s]) > RTOL * abs(ref[s]):
            return f"differs from step {s} ({losses[s]:.6f} vs {ref[s]:.6f}): samples lost or repeated"
    return "equal"


# ---------------------------------------------------------------------------------------------- hetspot


def dp_plan(setup: Setup, names: list[str]) -> Plan:
    b, m = setup.global_batch, setup.model
    share = b // len(names)
    return Plan(model_name=m.name, num_layers=m.num_layers, global_batch=b, pipelines=[Pipeline(
        num_samples=share, micro_batch_size=share, num_micro_batches=1, stages=[Stage(
            layer_start=0, layer_end=m.num_layers, gpu_type="L4", node=n, devices=[f"{n}/0"])]) for n in names])


def run_controller(ec: EmbeddedCluster, setup: Setup, nodes: list[NodeSpec], plan: Plan, doomed: str | None,
                   recovery: str = "in-place") -> dict:
    j = setup.job.model_copy(update={"cluster": ClusterSpec(nodes=nodes), "runtime": setup.job.runtime.model_copy(
        update={"recovery": recovery})})
    c = make_controller(j, steps=setup.steps, first_plan=plan)
    out: dict = {}
    try:
        if doomed is not None:
            while c.progress.committed < setup.kill_after:
                c.step()
            committed = c.progress.committed
            step, receipts = c.store._receipts[-1]  # the newest snapshot's copies to peer keepers are in
            ray.get(receipts, timeout=60)
            t0 = time.perf_counter()
            ec.remove(doomed)
            while c.progress.committed <= committed:
                c.step()
            restore = next(e for e in reversed(c.progress.events) if e["kind"] == "restore")
            out = {"first_step_s": time.perf_counter() - t0, "lost": committed - restore["step"],
                   "storage_bytes": restore["bytes_by_tier"].get("s3", 0),
                   "layout": [(s.layer_start, s.layer_end, s.tp) for p in c.plan.pipelines for s in p.stages]}
        while c.state not in (State.DONE, State.FAILED):
            c.step()
        assert c.state == State.DONE, c.error
        return out | {"losses": dict(c.progress.losses)}
    finally:
        if c.group is not None:
            c.group.shutdown()


def hetspot_trials(ec: EmbeddedCluster, setup: Setup, kills: int, stay: list[NodeSpec]) -> tuple[dict, list]:
    ref = run_controller(ec, setup, stay + [_fresh(ec, "hs-ref")], dp_plan(setup, [n.name for n in stay] + ["hs-ref"]),
                         None)["losses"]
    ec.remove("hs-ref")
    trials = []
    for i in range(kills):
        for recovery in ("in-place", "restart"):
            doomed = _fresh(ec, f"hs-{recovery}-{i}")
            names = [n.name for n in stay] + [doomed.name]
            t = run_controller(ec, setup, stay + [doomed], dp_plan(setup, names), doomed.name, recovery)
            trials.append(t | {"system": f"hetspot ({recovery})", "oracle": oracle(t["losses"], ref)})
    return ref, trials


def hetero_trial(ec: EmbeddedCluster, setup: Setup, ref: dict[int, float], i: int) -> dict:
    """A TP-2 first stage on an A100 node, one L4 stage each on two nodes; the last L4 node is killed."""
    a100 = _fresh(ec, f"het-a100-{i}", "A100-80GB", 2)
    l4a, l4b = _fresh(ec, f"het-l4a-{i}"), _fresh(ec, f"het-l4b-{i}")
    layers, b = setup.model.num_layers, setup.global_batch

    def st(lo, hi, n, tp=1):
        return Stage(layer_start=lo, layer_end=hi, gpu_type=n.gpu_type, node=n.name,
                     devices=[f"{n.name}/{k}" for k in range(tp)])
    plan = Plan(model_name=setup.model.name, num_layers=layers, global_batch=b, pipelines=[Pipeline(
        num_samples=b, micro_batch_size=b // 2, num_micro_batches=2,
        stages=[st(0, layers // 2, a100, 2), st(layers // 2, layers - 1, l4a), st(layers - 1, layers, l4b)])])
    try:
        t = run_controller(ec, setup, [a100, l4a, l4b], plan, l4b.name)
        return t | {"oracle": oracle(t["losses"], ref)}
    finally:
        for n in (a100.name, l4a.name):
            ec.remove(n)


def _fresh(ec: EmbeddedCluster, name: str, gpu: str = "L4", gpus: int = 1) -> NodeSpec:
    n = node(name, gpu, gpus)
    ec.nodes[name] = ec.add(n)
    return n


# -------------------------------------------------------------------------------------------- the peers


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write(path: str, row: dict) -> None:
    with open(path, "a") as f:  # one short line per write: appends from several processes stay whole
        f.write(json.dumps(row) + "\n")


def _model(setup_cfg: dict):
    from planner.specs import ModelSpec
    from workers.model import Stage as Layers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = ModelSpec.model_validate(setup_cfg["model"])
    return Layers(spec, 0, spec.num_layers, True, True).double(), spec


def ray_train_loop(cfg: dict) -> None:
    """Ray Train worker: DDP on the whole model, the global batch split evenly over the workers there are,
    a checkpoint every step from rank 0, resumed from the latest (Ray's fault-tolerance guide)."""
    import torch.distributed as dist
    from ray import train
    from ray.train import Checkpoint

    from workers.data import SyntheticCorpus

    module, spec = _model(cfg)
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ddp = torch.nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg["lr"])
    start, read = 0, 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            p = Path(d) / "state.pt"
            read = p.stat().st_size
            state = torch.load(p, weights_only=False)
        module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"] + 1
    b = cfg["global_batch"]
    share = [b // world + (i < b % world) for i in range(world)]
    data = SyntheticCorpus(spec.vocab_size, spec.seq_len)
    attempt = f"{world}-{start}-{time.time():.3f}"
    for s in range(start, cfg["steps"]):
        lo = s * b + sum(share[:rank])
        tokens = data.batch(range(lo, lo + share[rank]))
        loss_sum = module.loss_sum(ddp(tokens[:, :-1]), tokens[:, 1:])
        (loss_sum * world / b).backward()  # DDP averages over the workers: the global batch's mean
        opt.step()
        opt.zero_grad()
        total = loss_sum.detach().clone()
        dist.all_reduce(total)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                torch.save({"model": module.state_dict(), "optim": opt.state_dict(), "step": s}, Path(d) / "state.pt")
            train.report({"step": s, "loss": float(total) / b},
                         checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)
        if rank == 0:  # reported: the checkpoint is in storage, the step is committed
            _write(cfg["log"], {"step": s, "loss": float(total) / b, "t": time.time(), "attempt": attempt,
                                "world": world, "read": read * world if s == start and start else 0,
                                "samples": [s * b, (s + 1) * b]})


START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train V2's own knob (default 60 s)


def ray_train_run(setup: Setup, log: Path, storage: Path, elastic: bool = True,
                  start_timeout_s: float | None = None) -> None:
    """One `TorchTrainer.fit()`; `start_timeout_s` sets the worker-group start timeout, which Ray Train passes
    from the driver's environment to its controller (ray.train.v2 ENV_VARS_TO_PROPAGATE)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"model": setup.model.model_dump(), "lr": setup.lr, "global_batch": setup.global_batch,
                           "steps": setup.steps, "log": str(log)},
        scaling_config=ScalingConfig(num_workers=(setup.workers - 1, setup.workers) if elastic else setup.workers,
                                     use_gpu=True),
        torch_config=TorchConfig(backend="gloo"),
        run_config=RunConfig(storage_path=str(storage), name=log.stem, failure_config=FailureConfig(max_failures=-1)),
    )
    before = os.environ.get(START_TIMEOUT_VAR)
    if start_timeout_s is not None:
        os.environ[START_TIMEOUT_VAR] = f"{start_timeout_s:g}"
    try:
        trainer.fit()
    finally:
        if before is None:
            os.environ.pop(START_TIMEOUT_VAR, None)
        else:
            os.environ[START_TIMEOUT_VAR] = before


@ray.remote(num_gpus=1, num_cpus=1, max_restarts=0)
class TorchftGroup:
    """One torchft replica group (one process, one GPU) on one node: train_ddp.py's set-up."""

    def __init__(self, cfg: dict, group: int, groups: int, lighthouse: str):
        from datetime import timedelta

        import torch.distributed as dist
        from torchft import Manager, Optimizer, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        from workers.data import SyntheticCorpus

        os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse
        module, spec = _model(cfg)
        inner = torch.optim.AdamW(module.parameters(), lr=cfg["lr"])
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
        read = {"bytes": 0}

        def load_state_dict(sd):
            module.load_state_dict(sd["model"])
            inner.load_state_dict(sd["optim"])
            read["bytes"] += sum(t.numel() * t.element_size() for t in sd["model"].values())

        manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict,
                          state_dict=lambda: {"model": module.state_dict(), "optim": inner.state_dict()},
                          replica_id=f"peers_{group}", timeout=timedelta(seconds=30), rank=0, world_size=1,
                          store_addr="127.0.0.1", store_port=store.port,
                          checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10),
                                                           device=torch.device("cpu")))
        self.cfg, self.group, self.groups, self.read, self.manager = cfg, group, groups, read, manager
        self.store = store  # the replica group's TCPStore: the quorum's groups meet in it while it lives
        self.module, self.spec = module, spec
        self.opt = Optimizer(manager, inner)
        self.data = SyntheticCorpus(spec.vocab_size, spec.seq_len)

    def run(self) -> None:
        """Train to cfg's steps (every group is up and heartbeating to the Lighthouse before any starts)."""
        cfg, group, manager, module, opt = self.cfg, self.group, self.manager, self.module, self.opt
        b = cfg["global_batch"]
        share = b // self.groups
        read, data = self.read, self.data
        batch = 0  # the group's data loader position: it moves on every iteration, committed or not
        try:
            while manager.current_step() < cfg["steps"]:
                step = manager.current_step()
                opt.zero_grad()  # starts the quorum
                lo = batch * b + group * share
                tokens = data.batch(range(lo, lo + share))
                loss_sum = module.loss_sum(module(tokens[:, :-1]), tokens[:, 1:])
                (loss_sum / share).backward()
                # Averaged over the groups in the quorum, as torchft.DistributedDataParallel's comm hook does
                # (allreduce, wait). That class itself fails in 0.2.0 once a peer dies: on its error path the
                # manager returns a _DummyWork whose plain Future the hook asserts is managed. Waiting here
                # also matters on CPU, where should_commit does not wait for gloo's pending allreduces.
                for p in module.parameters():
                    manager.allreduce(p.grad).wait()  # the allreduce, then the division by the participants
                opt.step()  # applies the update only if every group in the quorum committed
                batch += 1
                if manager.current_step() > step:
                    _write(cfg["log"], {"step": step, "group": group, "loss_sum": float(loss_sum), "n": share,
                                        "t": time.time(), "healed": read["bytes"], "samples": [lo, lo + share],
                                        "participants": manager.num_participants()})
        finally:
            manager.shutdown(wait=False)


def torchft_run(setup: Setup, log: Path, node_ids: list[str], kill: callable | None = None) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from torchft.coordination import LighthouseServer

    lh = LighthouseServer(bind="[::]:0", min_replicas=1, quorum_tick_ms=100, join_timeout_ms=10000)
    try:
        cfg = {"model": setup.model.model_dump(), "lr": setup.lr, "global_batch": setup.global_batch,
               "steps": setup.steps, "log": str(log)}
        groups = [TorchftGroup.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(
            cfg, i, len(node_ids), lh.address()) for i, nid in enumerate(node_ids)]
        ray.get([g.__ray_ready__.remote() for g in groups], timeout=300)  # every Manager heartbeats: one quorum
        runs = [g.run.remote() for g in groups]
        if kill is not None:
            kill()
        for i, r in enumerate(runs):
            try:
                ray.get(r, timeout=600)
            except ray.exceptions.RayActorError:
                assert kill is not None and i == len(runs) - 1, f"torchft group {i} died"
    finally:
        lh.shutdown()


def torchft_losses(rows: list[dict], b: int) -> dict[int, float]:
    """The global loss of each committed step: the groups that committed it, their loss sums over their samples."""
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["step"], []).append(r)
    return {s: sum(r["loss_sum"] for r in rs) / sum(r["n"] for r in rs) for s, rs in sorted(by.items())}


def watch_and_kill(ec: EmbeddedCluster, log: Path, setup: Setup, doomed: str, box: dict,
                   writers: int = 1) -> threading.Thread:
    """Kill `doomed` once step kill_after is committed (by all `writers` of the system's log); note when."""
    def run():
        while sum(r["step"] >= setup.kill_after for r in _records(log)) < writers:
            time.sleep(0.02)
        box["t"] = time.time()
        ec.remove(doomed)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def after_kill(rows: list[dict], box: dict, without) -> dict:
    """From the kill to the first step committed without the killed node (`without(row)`), the committed steps
    lost or redone then (the newest step committed before it, less the one it follows), the bytes read to
    recover, and the samples the committed steps trained against those of an uninterrupted run."""
    first = min((r for r in rows if r["t"] > box["t"] and without(r)), key=lambda r: r["t"])
    before = max(r["step"] for r in rows if r["t"] < first["t"])
    return {"first_step_s": first["t"] - box["t"], "lost": before - (first["step"] - 1),
            "storage_bytes": max([r.get("read", 0) for r in rows if r["t"] > box["t"]], default=0)}


def sample_audit(rows: list[dict], b: int, steps: int) -> tuple[int, int]:
    """(samples an uninterrupted run trains that no committed step trained, samples trained twice), along the
    trajectory the model took: a step redone after a rollback to a checkpoint replaces the first try."""
    last = {(r["step"], r.get("group")): r for r in rows}
    seen: dict[int, int] = {}
    for r in last.values():
        for i in range(*r["samples"]):
            seen[i] = seen.get(i, 0) + 1
    lost = sum(1 for i in range(steps * b) if i not in seen)
    return lost, sum(n - 1 for n in seen.values())


def coordinator_tick_s() -> float:
    """How often Ray Train's elastic policy sees the cluster's nodes anew: it asks Ray's autoscaling
    coordinator, which reads `ray.nodes()` once a tick (20 s in Ray 2.60)."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            _AutoscalingCoordinatorActor,
        )
        return float(_AutoscalingCoordinatorActor.TICK_INTERVAL_S)
    except (ImportError, AttributeError):
        return 20.0


def wait_all_gpus_free(num_nodes: int, added_at: float, timeout_s: float = 120.0) -> None:
    """Until the cluster shows `num_nodes` live GPU nodes, every one of their GPUs free, and Ray Train's view
    of the nodes has been renewed since the newest was added (`added_at`, time.monotonic()). Ray Train places
    its workers itself and starts with what it sees ready (elastic), so a trial started while the last
    run's workers still hold a GPU, or before its view holds a new node, trains on fewer workers, and the
    node the trial kills may hold none (a 'recovery' that recovers nothing)."""
    deadline = time.monotonic() + timeout_s
    renewed = added_at + coordinator_tick_s() + 1.0
    while True:
        alive = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]
        total = sum(n["Resources"]["GPU"] for n in alive)
        if len(alive) == num_nodes and ray.available_resources().get("GPU", 0) >= total \
                and time.monotonic() >= renewed:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(alive)} GPU nodes alive ({num_nodes} wanted) and not all their GPUs free "
                               f"after {timeout_s:.0f} s")
        time.sleep(0.2)


def ray_train_trials(ec: EmbeddedCluster, setup: Setup, kills: int, work: Path,
                     start_timeout_s: float | None = None, tries: int = 3) -> tuple[dict, list]:
    """Ray Train's kills: as its docs set it up, or (`start_timeout_s`) with a shorter worker-group start
    timeout, the one knob that decides its recovery time here (docs/benchmarks.md, "Recovery beside the peers").
    A kill whose steps before it did not run on every node is tried again (up to `tries` times), and fails the
    bench after."""
    tag = "rt" if start_timeout_s is None else f"rt{start_timeout_s:g}s"
    system = "Ray Train (elastic)" if start_timeout_s is None else \
        f"Ray Train (elastic, start timeout {start_timeout_s:g} s)"
    ref_log = work / f"{tag}-ref.jsonl"
    extra = _fresh(ec, f"{tag}-ref")
    wait_all_gpus_free(setup.workers, time.monotonic())
    ray_train_run(setup, ref_log, work / "rt-storage", start_timeout_s=start_timeout_s)
    ec.remove(extra.name)
    ref_rows = _records(ref_log)
    if any(r["world"] != setup.workers for r in ref_rows):
        raise RuntimeError(f"Ray Train's uninterrupted run did not train on {setup.workers} workers throughout")
    ref = {r["step"]: r["loss"] for r in ref_rows}
    trials = []
    for i in range(kills * tries):
        if len(trials) == kills:
            break
        doomed = _fresh(ec, f"{tag}-{i}")
        log, box = work / f"{tag}-{i}.jsonl", {}
        wait_all_gpus_free(setup.workers, time.monotonic())
        th = watch_and_kill(ec, log, setup, doomed.name, box)
        ray_train_run(setup, log, work / "rt-storage", start_timeout_s=start_timeout_s)
        th.join()
        rows = _records(log)
        if any(r["world"] != setup.workers for r in rows if r["t"] < box["t"]):
            print(f"{system}: kill {i} discarded, its steps before the kill ran on fewer than {setup.workers} "
                  "workers (Ray Train started with what it saw ready)")
            continue
        losses = {r["step"]: r["loss"] for r in rows}  # a redone step's last report wins
        trials.append(after_kill(rows, box, lambda r: r["world"] < setup.workers)
                      | {"system": system, "losses": losses, "oracle": oracle(losses, ref),
                         "samples": sample_audit(rows, setup.global_batch, setup.steps)})
    if len(trials) < kills:
        raise RuntimeError(f"{system}: only {len(trials)} of {kills} kills started on every node in {kills * tries} "
                           "tries")
    return ref, trials


def torchft_trials(ec: EmbeddedCluster, setup: Setup, kills: int, work: Path, stay_ids: list[str]) -> tuple[dict, list]:
    ref_log = work / "tft-ref.jsonl"
    extra = _fresh(ec, "tft-ref")
    torchft_run(setup, ref_log, stay_ids + [ec.nodes[extra.name].node_id])
    ec.remove(extra.name)
    ref = torchft_losses(_records(ref_log), setup.global_batch)
    print(f"torchft's uninterrupted run: samples lost, trained twice: "
          f"{sample_audit(_records(ref_log), setup.global_batch, setup.steps)}", file=sys.stderr)  # progress
    if os.environ.get("PEERS_VERBOSE"):
        print("torchft reference:", [(r["step"], r["group"], r["participants"]) for r in _records(ref_log)])
    trials = []
    for i in range(kills):
        doomed = _fresh(ec, f"tft-{i}")
        log, box = work / f"tft-{i}.jsonl", {}
        torchft_run(setup, log, stay_ids + [ec.nodes[doomed.name].node_id],
                    kill=lambda log=log, box=box, name=doomed.name: watch_and_kill(ec, log, setup, name, box,
                                                                                   setup.workers).join())
        rows = _records(log)
        losses = torchft_losses(rows, setup.global_batch)
        if os.environ.get("PEERS_VERBOSE"):
            print(f"torchft kill {i} at {box['t']:.3f}:", [(r["step"], r["group"], r["participants"], round(r["t"], 3))
                                                       for r in rows])
        trials.append(after_kill(rows, box, lambda r: r["participants"] < setup.workers)
                      | {"system": "torchft", "losses": losses, "oracle": oracle(losses, ref),
                         "samples": sample_audit(rows, setup.global_batch, setup.steps)})
    return ref, trials


# ------------------------------------------------------------------------------------------------- main


def run(kills: int = 5, steps: int = 8, kill_after: int = 3, preset: str = "small",
        systems: tuple[str, ...] = SYSTEMS, hetero: int = 3, ray_train_timeout_s: float = 5.0) -> dict:
    setup = Setup(preset=preset, steps=steps, kill_after=kill_after)
    stay = [node("stay-0"), node("stay-1")]
    ec = EmbeddedCluster(ClusterSpec(nodes=stay))
    ec.connect()
    load = [os.getloadavg()[0]]
    out: dict = {"trials": [], "refs": {}, "hetero": []}
    try:
        with tempfile.TemporaryDirectory(prefix="hetspot-peers-") as tmp:
            work = Path(tmp)
            if "hetspot" in systems:
                ref, t = hetspot_trials(ec, setup, kills, stay)
                out["refs"]["hetspot"], out["trials"] = ref, out["trials"] + t
                load.append(os.getloadavg()[0])
                out["hetero"] = [hetero_trial(ec, setup, ref, i) for i in range(hetero)]
            if "ray-train" in systems:
                ref, t = ray_train_trials(ec, setup, kills, work)
                out["refs"]["ray-train"], out["trials"] = ref, out["trials"] + t
                load.append(os.getloadavg()[0])
            if "ray-train-tuned" in systems:
                ref, t = ray_train_trials(ec, setup, kills, work, ray_train_timeout_s)
                out["refs"]["ray-train-tuned"], out["trials"] = ref, out["trials"] + t
                load.append(os.getloadavg()[0])
            if "torchft" in systems:
                ids = [ec.nodes[n.name].node_id for n in stay]
                ref, t = torchft_trials(ec, setup, kills, work, ids)
                out["refs"]["torchft"], out["trials"] = ref, out["trials"] + t
                load.append(os.getloadavg()[0])
    finally:
        ec.shutdown()
    out["load"] = load
    return out


def summary(out: dict) -> dict:
    """Per system: the kills' first-step times and median, steps lost or redone, storage bytes, samples, oracle."""
    rows: dict[str, dict] = {}
    for t in out["trials"]:
        r = rows.setdefault(t["system"], {"first_step_s": [], "lost": [], "storage_bytes": [], "samples": [],
                                          "oracle": []})
        for k in r:
            r[k].append(t.get(k))
    for r in rows.values():
        r["median_first_step_s"] = statistics.median(r["first_step_s"])
    return {"systems": rows, "hetero": [{k: h[k] for k in ("first_step_s", "lost", "layout", "oracle")}
                                        for h in out["hetero"]], "load": out["load"]}


def report(out: dict, setup_line: str) -> None:
    trials = out["trials"]
    systems = list(dict.fromkeys(t["system"] for t in trials))
    med = {s: statistics.median(t["first_step_s"] for t in trials if t["system"] == s) for s in systems}
    base = med.get("hetspot (in-place)")
    print(f"\n{setup_line}; load average (1 min) during the run: "
          + ", ".join(f"{x:.1f}" for x in out["load"]) + f" on {os.cpu_count()} cores")
    print("\n| system | kills | kill -> first new step s (median; each) | committed steps lost or redone | "
          "bytes read from storage | samples lost, trained twice | losses vs its uninterrupted run "
          "| hetspot in place / this |")
    print("|---|---|---|---|---|---|---|---|")
    for s in systems:
        ts = [t for t in trials if t["system"] == s]
        each = ", ".join(f"{t['first_step_s']:.2f}" for t in ts)
        oracles = sorted({t["oracle"] for t in ts})
        verdict = "equal (every kill)" if oracles == ["equal"] else "; ".join(oracles)
        ratio = f"{base / med[s]:.2f}" if base else "-"
        samples = "; ".join(f"{a}, {b}" for a, b in sorted({t["samples"] for t in ts})) if "samples" in ts[0] else \
            "the same (losses)"
        print(f"| {s} | {len(ts)} | {med[s]:.2f} ({each}) | {sorted({t['lost'] for t in ts})} "
              f"| {statistics.median(t['storage_bytes'] for t in ts) / 2**20:.2f} MiB | {samples} | {verdict} "
              f"| {ratio} |")
    for h in out["hetero"]:
        print(f"heterogeneous (A100 TP-2 + 2 L4 PP stages, last L4 killed): first new step {h['first_step_s']:.2f} s, "
              f"lost {h['lost']}, layout after {h['layout']}, losses vs hetspot's uninterrupted DP run: {h['oracle']}")
    refs = out["refs"]
    if len(refs) > 1:  # same model, batch and data source, but each system's own initialisation and order
        names = list(refs)
        gaps = {n: max(abs(refs[n][s] - refs[names[0]][s]) / abs(refs[names[0]][s]) for s in refs[names[0]])
                for n in names[1:]}
        print(f"uninterrupted runs against {names[0]}'s (each system initialises and orders samples its own "
              "way, so each is held to its own): largest relative gap " + ", ".join(f"{n} {g:.1e}"
                                                                                  for n, g in gaps.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=5, help="kills per system (and per hetspot recovery path)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kill-after", type=int, default=3, help="the committed step after which the node is killed")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="any of " + ", ".join(SYSTEMS))
    ap.add_argument("--ray-train-timeout", type=float, default=5.0,
                    help=f"ray-train-tuned's worker-group start timeout, s ({START_TIMEOUT_VAR}; Ray's default 60)")
    ap.add_argument("--hetero", type=int, default=3, help="heterogeneous (layout change) kills of hetspot")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("-v", action="store_true", help="show moto's request log, Ray's echo of the injected failures "
                    "and the systems' recovery warnings")
    args = ap.parse_args()
    from bench.quiet import quiet

    quiet(args.v)
    try:
        import torchft  # noqa: F401
        from ray import train  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench/peers.py needs the peers extra: pip install -e '.[peers]' ({e})")
    systems = tuple(args.systems.split(","))
    if unknown := sorted(set(systems) - set(SYSTEMS)):
        ap.error(f"--systems: unknown {', '.join(unknown)}; give any of {', '.join(SYSTEMS)}")  # exit 2
    out = run(args.kills, args.steps, args.kill_after, args.preset, systems, args.hetero, args.ray_train_timeout)
    if args.json:
        Path(args.json).write_text(json.dumps(summary(out), indent=1))
    report(out, f"`python bench/peers.py --kills {args.kills} --steps {args.steps} --kill-after {args.kill_after}` "
           f"({args.preset}, 3 nodes x 1 fake L4, global batch 12, float64)")


if __name__ == "__main__":
    main()
