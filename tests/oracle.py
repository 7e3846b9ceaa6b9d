"""The equivalence oracle without Ray: a job trained on one device in this process (one Engine, one rank).

For tests whose Ray cluster cannot host the reference run (an autoscaling cluster owns the machine's Ray),
the losses of the 1-device plan of a job's model, training settings, data and dtype.
"""

from __future__ import annotations

from orchestrator.job_spec import JobSpec
from planner import Pipeline, Plan, Stage
from tests.net import free_port


def one_device_losses(job: JobSpec, steps: int) -> list[float]:
    from workers.data import make_dataset
    from workers.engine import DTYPES, Engine

    m, t = job.model_spec, job.train
    plan = Plan(model_name=m.name, num_layers=m.num_layers, global_batch=t.global_batch, pipelines=[Pipeline(
        num_samples=t.global_batch, micro_batch_size=t.global_batch, num_micro_batches=1,
        stages=[Stage(layer_start=0, layer_end=m.num_layers, gpu_type="A100-80GB", node="ref", devices=["ref/0"])])])
    d = job.data
    data = make_dataset(d.kind, m.seq_len, m.vocab_size, t.seed, d.path, d.dtype)
    dtype = DTYPES[job.runtime.dtype if job.runtime.dtype != "auto" else "float32"]
    e = Engine(plan, 0, m, t, data, dtype)
    port = free_port()
    e.connect(f"tcp://127.0.0.1:{port}", 30)
    try:
        return [e.step(s).loss for s in range(steps)]
    finally:
        e.close()
