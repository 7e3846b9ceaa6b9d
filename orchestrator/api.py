"""The Python API behind the CLI: tests and notebooks call these, the CLI only parses and prints."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError, ControllerLost, JobFailed
from orchestrator.job_spec import JobSpec, format_validation, load_job, require_cluster
from planner import Plan, PlanningError, evaluate
from planner import plan as make_plan
from planner.baselines import all_baselines
from planner.contract import PlanContractError, plan_problems
from planner.fleet import Catalog
from planner.search import Planner
from planner.specs import tokens_per_step


def plan_job(job: JobSpec, source: str = "<job>", objective: str = "throughput",
             best: Plan | None = None) -> dict[str, Any]:
    """Plan a job on its `cluster:` (or take `best`, planned already) and score the baselines. Returns the
    JSON-able result. A job with `fleet:` types and no `cluster:` is planned on its fleet at the most nodes."""
    from orchestrator.job_spec import fleet_cluster

    cluster = job.cluster or fleet_cluster(job) or require_cluster(job, source)
    model, train = job.model_spec, job.train
    planner = Planner(model, train)  # the baselines reuse its cost caches
    planner.explain = True  # a refusal names the least host RAM that plans
    try:
        best = best or planner.plan(cluster, objective)
    except PlanningError as e:
        raise ConfigError(f"{source}: {e}") from None
    baselines = {}
    full = best if objective == "throughput" else None
    for name, bp in all_baselines(cluster, model, train, planner, full).items():
        baselines[name] = None if bp is None else {
            "estimate": bp.estimate.model_dump(),
            "speedup": bp.estimate.step_time_s / best.estimate.step_time_s,
            "num_pipelines": len(bp.pipelines),
        }
        if bp is not None and objective == "cost" and best.estimate.cost_per_mtok and bp.estimate.cost_per_mtok:
            # >1: hetspot is cheaper
            baselines[name]["cost_ratio"] = bp.estimate.cost_per_mtok / best.estimate.cost_per_mtok
    return {
        "job": job.name,
        "objective": objective,
        "model": model.model_dump() | {"num_params": model.num_params},
        "plan": best.model_dump(),
        "estimate": best.estimate.model_dump(),
        "baselines": baselines,
    }


def load_catalog(path: str | Path):
    """An instance-type catalog file (planner/fleet.py's Catalog: `types:`, optional `max_types:`,
    `quota_gpus:`); any problem is one ConfigError naming the field and the fix."""
    from pydantic import ValidationError

    from orchestrator.job_spec import _read_yaml
    from planner.fleet import Catalog

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"catalog file {str(p)!r} {'is a directory' if p.is_dir() else 'does not exist'}; pass "
                          "a YAML catalog of instance types (see examples/catalog-aws.yaml)")
    data = _read_yaml(p, "catalog")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: a catalog must be a YAML mapping with a types: list (see examples/catalog-aws.yaml)")
    try:
        return Catalog.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation(str(p), e, "catalog")) from None
    except ValueError as e:
        raise ConfigError(f"{p}: {e}") from None


def plan_fleet(job: JobSpec, source: str, catalog_path: str | Path | Catalog, objective: str = "cost",
               budget_per_hour: float | None = None, progress=None, min_tokens_per_s: float | None = None,
               deadline_h: float | None = None, workers: int = 1) -> dict[str, Any]:
    """`hetspot plan --fleet auto`: choose the fleet to request from a catalog and plan on it (planner/fleet.py).
    Returns plan_job's result for the chosen fleet, with a `fleet` section: the choice beside the next best two
    and the best single-type fleet. `workers`: processes that plan candidate fleets at once (forked; the
    choice is the same for any number)."""
    from planner.fleet import choose_fleet

    catalog = catalog_path if isinstance(catalog_path, Catalog) else load_catalog(catalog_path)
    if budget_per_hour is not None and (not budget_per_hour > 0 or budget_per_hour == float("inf")):
        raise ConfigError(f"--budget {budget_per_hour} must be a positive $/h")
    for flag, v in (("--min-tokens-per-s", min_tokens_per_s), ("--deadline-h", deadline_h)):
        if v is not None and not (0 < v < float("inf")):
            raise ConfigError(f"{flag} {v} must be a positive number")
    if min_tokens_per_s is not None and deadline_h is not None:
        raise ConfigError("give one of --min-tokens-per-s or --deadline-h (a deadline sets the floor)")
    if deadline_h is not None:  # the job's tokens within the deadline: a floor on what the fleet delivers
        from planner.specs import tokens_per_step

        min_tokens_per_s = tokens_per_step(job.model_spec, job.train.global_batch) * job.steps / (deadline_h * 3600)
    try:
        choice = choose_fleet(catalog, job.model_spec, job.train, objective, budget_per_hour, progress,
                              min_tokens_per_s, workers)
    except PlanningError as e:
        raise ConfigError(f"{source}: {e}") from None

    def row(o, label):
        return {"label": label, "fleet": [{"type": name, "nodes": n} for name, n in o.fleet],
                "price_per_hour": o.price_per_hour, "cost_per_mtok": o.cost_per_mtok, "tokens_per_s": o.tokens_per_s,
                "effective_tokens_per_s": o.effective_tokens_per_s, "preemption_loss": o.plan.estimate.preemption_loss}

    rows = [row(choice.best, "chosen")] + [row(o, f"next best {i}") for i, o in enumerate(choice.runners_up, 1)]
    if choice.best_single is not None:
        rows.append(row(choice.best_single, "best single type"))
    out = plan_job(job.model_copy(update={"cluster": catalog.cluster(choice.best.fleet)}), source,
                   objective, best=choice.best.plan)
    out["fleet"] = {"objective": objective, "budget_per_hour": budget_per_hour, "min_tokens_per_s": min_tokens_per_s,
                    "options": rows,
                    "fleets_planned": choice.planned, "fleets_within_limits": choice.space}
    return out


def choose_job_fleet(job: JobSpec, source: str) -> str:
    """The fleet a job file's `fleet: {auto: ...}` asks for (the driver makes the same choice on the cluster),
    described for a person; ConfigError (exit 2) when the model fits no fleet of the catalog."""
    from orchestrator.control.fleet_choice import choose, describe

    try:
        choice, _ = choose(job)
    except PlanningError as e:
        raise ConfigError(f"{source}: field 'fleet.auto': {e}") from None
    return describe(choice, job.fleet.auto.catalog)


def plan_file(path: str | Path, objective: str = "throughput") -> dict[str, Any]:
    return plan_job(load_job(path), str(path), objective)


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    if p.is_dir() or not p.is_file():
        raise ConfigError(f"plan file {str(p)!r} {'is a directory' if p.is_dir() else 'does not exist'}; "
                          "write one with `hetspot plan JOB.yaml --json`")
    import json

    from pydantic import ValidationError

    try:
        data = json.loads(p.read_text())
        plan = Plan.model_validate(data.get("plan", data) if isinstance(data, dict) else data)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON (line {e.lineno}): {e.msg}") from None
    except (UnicodeDecodeError, RecursionError):
        raise ConfigError(f"{p}: not a plan file (not UTF-8 JSON); write one with "
                          "`hetspot plan JOB.yaml --json`") from None
    except ValidationError as e:
        raise ConfigError(format_validation(str(p), e, "plan")) from None
    return plan


def check_plan(plan: Plan, job: JobSpec, source: str) -> Plan:
    """Check a user-supplied plan against the plan contract and the job; fill in its estimate."""
    cluster = require_cluster(job, source)
    problems = plan_problems(plan, job.model_spec, job.train, cluster)
    if problems:
        raise ConfigError(f"{source}: the plan does not match the job: " + "; ".join(problems)
                          + ". Fix: regenerate it with `hetspot plan JOB.yaml --json`.")
    try:
        plan.estimate = evaluate(plan, cluster, job.model_spec, job.train)
    except PlanContractError as e:
        raise ConfigError(f"{source}: {e}") from None
    return plan


def check_data(job: JobSpec, source: str) -> JobSpec:
    """The job's data against its model, before any cluster starts (exit 2 on a problem). Returns the job with its
    corpus indexed (`data.index`: every shard's size and version, workers/corpus_index.py; a job file that carries
    an index is checked against the corpus instead) and, where `train.epochs` bounds it, its steps."""
    from workers.data_validation import DataError, check_data

    d, m = job.data, job.model_spec
    try:
        check_data(d.kind, d.path, m.seq_len, m.vocab_size, d.dtype, d.endpoint_url)
        if d.val_path:
            check_data(d.kind, d.val_path, m.seq_len, m.vocab_size, d.dtype, d.endpoint_url)
        job = with_index(job)
        check_held_out(job)
        return with_epochs(job)
    except DataError as e:
        raise ConfigError(f"{source}: {e}") from None


def with_index(job: JobSpec) -> JobSpec:
    """The job with its corpus's index: made now, or the job file's own checked against the corpus."""
    from orchestrator.job_spec import CorpusIndex
    from workers.corpus_index import index_corpus
    from workers.data_validation import DataError

    d = job.data
    if d.kind == "synthetic" or d.path is None:
        return job
    found = CorpusIndex.model_validate({
        "shards": index_corpus(d.path, d.endpoint_url),
        "val_shards": index_corpus(d.val_path, d.endpoint_url, "data.val_path") if d.val_path else None})
    if d.index is not None and d.index != found:
        pinned = {e.path: e for e in (d.index.shards + (d.index.val_shards or []))}
        now = {e.path: e for e in (found.shards + (found.val_shards or []))}
        diff = ([f"{p} is gone" for p in pinned if p not in now] + [f"{p} is new" for p in now if p not in pinned]
                + [f"{p} is {now[p].bytes:,} bytes ({now[p].version}), indexed at {e.bytes:,} ({e.version})"
                   for p, e in pinned.items() if p in now and now[p] != e])
        raise DataError(f"data.index: the corpus is not the one the job file pins ({'; '.join(diff[:3])}"
                        f"{f'; {len(diff) - 3} more' if len(diff) > 3 else ''}); put the shards back, or remove "
                        "data.index to train on the corpus as it is now")
    return job.model_copy(update={"data": d.model_copy(update={"index": found})})


def training_windows(job: JobSpec) -> int | None:
    """The samples of one epoch of the job's indexed corpus (workers/corpus_index.py); None where it has none."""
    from workers.corpus_index import training_windows as windows

    return windows(job.data.model_dump(), job.model_spec.seq_len)


def with_epochs(job: JobSpec) -> JobSpec:
    """`train.epochs` as the job's steps: ceil(epochs x an epoch's samples / global_batch)."""
    import math

    from workers.data_validation import DataError

    epochs = job.train.epochs
    if epochs is None:
        return job
    windows = training_windows(job)
    if windows is None:
        raise DataError("train.epochs counts passes over a corpus and synthetic data has none: set steps instead "
                        "(or data.kind tokens or text with data.path)")
    steps = max(1, math.ceil(epochs * windows / job.train.global_batch))
    if "steps" in job.model_fields_set and job.steps != steps:
        raise DataError(f"steps ({job.steps}) and train.epochs ({epochs:g}: {steps} steps of {job.train.global_batch}"
                        f" samples over {windows:,} windows) both bound the job; keep one of them")
    return job.model_copy(update={"steps": steps})


def check_held_out(job: JobSpec) -> None:
    """train.eval_every's held-out set: there is one, and it holds the samples an evaluation reads."""
    from workers.data_validation import DataError, corpus_windows

    d, t, m = job.data, job.train, job.model_spec
    if not t.eval_every:
        if d.val_fraction or d.val_path:
            warnings.warn(f"data.{'val_path' if d.val_path else 'val_fraction'} is set but train.eval_every is 0: no "
                          "validation loss is computed (set train.eval_every to the steps between evaluations); "
                          "held-out windows are still kept out of training",
                          stacklevel=2)
        return
    if d.kind == "synthetic":
        return  # another seed's samples
    if d.val_path:
        held = corpus_windows(d.kind, d.val_path, m.seq_len, d.dtype, d.endpoint_url) or 0
        where = f"data.val_path {d.val_path!r}"
    elif d.val_fraction:
        windows = corpus_windows(d.kind, d.path, m.seq_len, d.dtype, d.endpoint_url) or 0
        held = int(windows * d.val_fraction)
        where = f"data.val_fraction {d.val_fraction} of the corpus's {windows} windows"
        if held == 0:
            raise DataError(f"{where} is no whole window of seq_len + 1 = {m.seq_len + 1} tokens; raise it to at "
                            f"least {1 / max(windows, 1):.2g}")
    else:
        raise DataError("train.eval_every needs held-out data: set data.val_fraction (a share of the corpus kept out "
                        "of training) or data.val_path")
    need = t.eval_batches * t.global_batch
    if held < need:
        raise DataError(f"{where} holds {held} samples; an evaluation reads train.eval_samples = {need} (a multiple "
                        "of global_batch): lower train.eval_samples or hold out more")


def check_checkpoint(job: JobSpec, source: str, resume: bool, steps: int | None = None,
                     auto: bool = False) -> str | None:
    """The `checkpoint:` section against its bucket, before any worker starts (exit 2 on a problem). Returns the
    run the job goes on from a step of (the run id its steps record: the job keeps it, so it counts, loads and
    prunes those steps as its own), or None when it starts a new run: `resume` (--resume), or with `auto` (the Ray
    Jobs driver) when `checkpoint.resume` is auto and the prefix holds this job's steps. A prefix holding another
    job's or model's steps is refused either way: it is never resumed silently."""
    from orchestrator.state.s3_store import check_access
    from workers.corpus_index import data_digest

    c = job.checkpoint
    if c is None:
        if resume:
            raise ConfigError(f"{source}: --resume needs a 'checkpoint:' section whose uri holds the job's steps")
        return None
    try:
        store = check_access(c.uri, c.endpoint_url)
        done = store.complete_steps()
        newest = store.newest_whole() if done else None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    except Exception as e:  # noqa: BLE001 - S3 refused the listing or a manifest read (denied, throttled)
        from orchestrator.state.s3_store import s3_code

        raise ConfigError(f"{source}: reading the steps under checkpoint.uri {c.uri} was refused by S3 "
                          f"({s3_code(e)}); check the credentials and the bucket policy (s3:ListBucket, "
                          "s3:GetObject), or try again if S3 throttled it") from None
    if newest is not None:
        owner, model = newest[1].get("job"), newest[1].get("model")
        if owner is not None and owner != job.name:
            raise ConfigError(f"{source}: checkpoint.uri {c.uri} holds steps of job {owner!r} (newest {newest[0]}), "
                              f"not of {job.name!r}; give this job its own prefix (s3://{store.bucket}/{job.name}) "
                              f"or name it {owner!r} to go on with that job")
        if model is not None and model != job.model_spec.model_dump():
            raise ConfigError(f"{source}: checkpoint.uri {c.uri} holds steps of job {job.name!r} for another model "
                              f"({model.get('name')}, {model.get('num_layers')} layers); give this run its own prefix")
        data, going_on = newest[1].get("data"), resume or (auto and c.resume == "auto")
        if data is not None and going_on and data != data_digest(job.data.model_dump()):
            raise ConfigError(f"{source}: checkpoint.uri {c.uri} holds steps trained on another version of the data "
                              f"(data.path {job.data.path!r}: its shards, their contents or data.val_fraction "
                              "changed since); a resume picks samples by their index, so it would read others: put "
                              "the corpus back as it was, or start a new run with its own checkpoint.uri")
    resume = resume or (auto and c.resume == "auto" and newest is not None)
    if resume and newest is None:
        raise ConfigError(f"{source}: --resume: no complete step under {c.uri}"
                          + (f" (steps {done[:3]} are not whole)" if done else "")
                          + "; run without --resume to start the job")
    total = steps or job.steps
    if resume and newest[0] + 1 >= total:
        raise ConfigError(f"{source}: --resume: {c.uri} already holds step {newest[0]}, the job's last of {total}; "
                          f"pass --steps above {newest[0] + 1} to train further")
    if not resume and done:
        raise ConfigError(f"{source}: checkpoint.uri {c.uri} already holds steps (newest {done[0]}); pass --resume "
                          f"to go on from step {done[0] + 1}, give checkpoint.uri a new prefix, or delete them "
                          f"(`hetspot checkpoints rm {c.uri} --all`)")
    if not resume:
        return None
    import uuid

    return newest[1].get("run_id") or uuid.uuid4().hex[:12]  # an older step without a run id: a new lineage


def lost_controller_message(job: JobSpec, source: str, cause: str, steps: int | None = None) -> str:
    """One line for a controller that died: what happened, the newest complete step, the exact resume command."""
    head = f"the job's controller died ({cause})"
    if job.checkpoint is None:
        return f"{head}; the job has no checkpoint: section, so it starts over: hetspot submit {source}"
    from orchestrator.state.s3_store import S3Checkpoints

    try:
        newest = S3Checkpoints.at(job.checkpoint.location).newest_whole()
    except Exception as e:  # the message must still come out; say why the step is unknown
        return (f"{head}; the newest complete step under {job.checkpoint.uri} could not be read ({type(e).__name__}); "
                f"go on with: hetspot submit {source} --resume")
    if newest is None:
        return f"{head}; no complete step under {job.checkpoint.uri} yet, so it starts over: hetspot submit {source}"
    more = f" --steps {steps}" if steps else ""
    return (f"{head}; newest complete step {newest[0]} under {job.checkpoint.uri}; "
            f"go on from it with: hetspot submit {source} --resume{more}")


def with_restore_from(job: JobSpec, restore_from: str | None, source: str) -> JobSpec:
    """The job with `checkpoint.restore_from` set from `--restore-from` (nearest or s3)."""
    if restore_from is None:
        return job
    if restore_from not in ("nearest", "s3"):
        raise ConfigError(f"--restore-from {restore_from!r}: use nearest (survivors, peers, then S3) or s3")
    if job.checkpoint is None:
        raise ConfigError(f"{source}: --restore-from needs a 'checkpoint:' section (uri of the S3 tier)")
    return job.model_copy(update={"checkpoint": job.checkpoint.model_copy(update={"restore_from": restore_from})})


def submit_local(job_path: str | Path, plan_path: str | Path | None = None, steps: int | None = None,
                 on_step=None, on_status=None, replan_on_loss: bool = False, resume: bool = False,
                 restore_from: str | None = None) -> dict[str, Any]:
    """`hetspot submit` without --address: check, plan (or load --plan), start the embedded cluster, train."""
    source = str(job_path)
    job = with_restore_from(load_job(job_path), restore_from, source)
    cluster = require_cluster(job, source)
    job = check_data(job, source)  # with its corpus index (and its steps, where train.epochs bounds it)
    checkpoint_run = check_checkpoint(job, source, resume, steps)
    if plan_path is not None:
        plan = check_plan(load_plan(plan_path), job, str(plan_path))
    else:
        try:
            plan = make_plan(cluster, job.model_spec, job.train)
        except PlanningError as e:
            raise ConfigError(f"{source}: {e}") from None
    steps = steps or job.steps
    from orchestrator.cluster.embedded import EmbeddedCluster
    from orchestrator.control.controller import State
    from orchestrator.runtime.controller_actor import (
        ControllerActor,
        controller_name,
        drive,
        on_head,
    )

    status = on_status or (lambda m: None)
    status(f"starting embedded Ray cluster: {len(cluster.nodes)} nodes, {cluster.num_gpus} fake GPUs")
    from ray.exceptions import RayActorError
    t0 = time.perf_counter()
    ec = EmbeddedCluster(cluster)
    try:
        ec.connect()
        cluster_s = time.perf_counter() - t0
        run_id = f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"  # the run record's folder
        actor = ControllerActor.options(name=controller_name(job.name), **on_head()).remote(
            job.model_dump_json(), steps, run_id, True, plan.model_dump_json(), plan_path is not None, replan_on_loss,
            checkpoint_run=checkpoint_run)

        def on_row(row: dict) -> None:
            if on_step is not None:
                on_step(row["step"], row["loss"], row["tokens_per_s"])

        try:
            summary = drive(actor, on_row, on_phase=status)
        except RayActorError:
            raise ControllerLost(lost_controller_message(job, source, "its Ray actor died", steps)) from None
        wall = time.perf_counter() - t0
        if summary["state"] != State.DONE.value:
            raise JobFailed(summary["error"])
    finally:
        ec.shutdown()
    trained_s = sum(summary["step_time_s"])
    return {
        "job": job.name,
        "plan": summary["plan"],
        "first_step": summary["first_step"],
        "losses": summary["losses"],
        "samples": summary["samples"],
        "val_losses": summary["val_losses"],  # step -> the validation loss after it (train.eval_every)
        "step_time_s": summary["step_time_s"],
        "tokens_per_s": (tokens_per_step(job.model_spec, job.train.global_batch) * len(summary["losses"]) / trained_s
                         if trained_s > 0 else 0.0),
        "startup_s": cluster_s + (summary["startup_s"] or 0.0),
        "wall_s": wall,
        "restarts": summary["restarts"],
        "events": summary["events"],
        "uploads": summary["uploads"],
        "run_record": summary["run_record"],
    }


def inventory(address: str | None = None, job_path: str | Path | None = None, ec2_region: str | None = None,
              endpoint_url: str | None = None, token_file: str | None = None) -> dict[str, Any]:
    """The discovered GPUs: of a running cluster (--address), or of a job's embedded test cluster.

    An http(s) address is the dashboard: nodes come from its State API (token auth
    supported). HOST:6379 or 'auto' connects a Ray driver instead.
    """
    from orchestrator.cluster.discovery import RayInventory, to_cluster_spec
    from orchestrator.cluster.ec2 import Boto3SpotPrices, EC2Facts
    from orchestrator.cluster.holders import held_by_job

    started = None
    nodes_fn = None
    table_fn = None  # the placement group table: which hetspot job holds which GPUs
    if address and address.startswith(("http://", "https://")):
        from orchestrator.runtime.ray_jobs import RayJobs

        jobs = RayJobs(address, token_file)
        nodes_fn, table_fn = jobs.nodes, jobs.placement_groups
    else:
        import ray

        if not ray.is_initialized():
            if address:
                _check_reachable(address)
                try:
                    ray.init(address=address, logging_level="WARNING", log_to_driver=False)
                except (ConnectionError, RuntimeError, ValueError) as e:
                    raise ConfigError(f"cannot reach a Ray cluster at {address!r} ({type(e).__name__}: {e}); pass "
                                      "the dashboard URL (http://HEAD:8265), the GCS address (HOST:6379) or "
                                      "'auto'") from None
            elif job_path:
                from orchestrator.cluster.embedded import EmbeddedCluster

                started = EmbeddedCluster(require_cluster(load_job(job_path), str(job_path)))
                started.connect()
            else:
                raise ConfigError("pass --address http://HEAD:8265 (a running cluster) or --job JOB.yaml "
                                  "(its embedded test cluster)")
    try:
        nodes = RayInventory(nodes_fn).discover()
        if table_fn is None:
            from ray.util import placement_group_table as table_fn
        held = held_by_job(table_fn())
        if ec2_region or endpoint_url:
            import boto3

            client = boto3.client("ec2", region_name=ec2_region, endpoint_url=endpoint_url)
            nodes = EC2Facts(client, Boto3SpotPrices(client)).enrich(nodes)
        if not nodes:
            raise ConfigError("the cluster has no GPU node of a known type (see `planner/catalog.py` for types)")
        spec = to_cluster_spec(nodes)
    finally:
        if started is not None:
            started.shutdown()
    by_type: dict[str, int] = {}
    for n in spec.nodes:
        by_type[n.gpu_type] = by_type.get(n.gpu_type, 0) + n.num_gpus
    return {"cluster": spec.model_dump(), "gpus_by_type": by_type,
            "nodes": [{"name": n.name, "address": n.address, "gpu_type": n.gpu_type, "num_gpus": n.num_gpus,
                       "market": n.market, "zone": n.zone, "instance_type": n.instance_type,
                       "gpu_mem_gib": n.gpu_mem_gib, "price_per_hour": n.price_per_hour, "node_id": n.node_id,
                       "held": dict(sorted(held.get(n.node_id, {}).items()))}  # hetspot job -> its GPUs here
                      for n in nodes]}


def _check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, not minutes, when nothing listens at HOST:PORT (ray.init retries for long)."""
    import socket

    if address == "auto" or address.startswith(("ray://", "http://", "https://")):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--address {address!r} must be HOST:PORT (the head's GCS port, usually 6379) or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"cannot reach a Ray cluster at {address!r}: {e.strerror or e}. "
                          "Check the head is up (`ray start --head`) and the address is HOST:6379.") from None
