"""The equivalence oracle without Ray: a job trained on one device in this process (one Engine, one rank).

The losses (and final parameters) of the 1-device plan of a job's model, training settings, data and dtype. Tests
on Ray compare with it rather than run the reference on their cluster: an autoscaling cluster owns the machine's
Ray, and on the others a reference run costs a worker process (torch imported again) for seconds of training.
"""

from __future__ import annotations

from orchestrator.job_spec import JobSpec
from planner import Pipeline, Plan, Stage


def one_device_run(job: JobSpec, steps: int, val_losses: dict | None = None) -> tuple[list[float], dict]:
    """The 1-device run of `job` for `steps` steps in this process: its losses and final parameters (full
    tensors by canonical name), with the compute dtype a job's worker gives the plan's one stage. With
    `val_losses` (a dict, filled here) and `train.eval_every`, the validation losses where the controller
    evaluates (after every eval_every-th step and the last)."""
    from workers.data import make_datasets
    from workers.engine import DTYPES, Engine, compute_dtype
    from workers.state import assemble, export_shards

    m, t = job.model_spec, job.train
    gpu = "A100-80GB"
    plan = Plan(model_name=m.name, num_layers=m.num_layers, global_batch=t.global_batch, pipelines=[Pipeline(
        num_samples=t.global_batch, micro_batch_size=t.global_batch, num_micro_batches=1,
        stages=[Stage(layer_start=0, layer_end=m.num_layers, gpu_type=gpu, node="ref", devices=["ref/0"])])])
    d = job.data
    data = make_datasets(d.model_dump(), m.seq_len, m.vocab_size, t.seed)[0]  # as a worker makes it
    e = Engine(plan, 0, m, t, data, DTYPES[compute_dtype(job.runtime.dtype, t.precision, gpu)])
    e.connect_alone(30)
    every = t.eval_every if val_losses is not None else 0
    held_out = make_datasets(d.model_dump(), m.seq_len, m.vocab_size, t.seed, validation=True)[1] if every else None
    try:
        losses = []
        for s in range(steps):
            losses.append(e.step(s).loss)
            if held_out is not None and ((s + 1) % every == 0 or s + 1 == steps):
                val_losses[s] = e.evaluate(held_out, t.eval_batches)
        return losses, assemble([export_shards(e)])
    finally:
        e.close()


def one_device_losses(job: JobSpec, steps: int) -> list[float]:
    return one_device_run(job, steps)[0]
