"""Per-step metrics: Ray metrics (scraped by Prometheus), an optional TensorBoard log, structured logs.

`step_row` turns one committed step into the figures a user watches: loss,
tokens/s, MFU against the plan's fleet peak, step time and peak device memory.
`StepMetrics` publishes them as `ray.util.metrics` gauges tagged with the job
id (per stage: tagged with its pipeline, stage, GPU type and node, so a straggling
type shows), and recovery times as a histogram; Ray's metrics agent on each node exports them for Prometheus with the
`ray_` prefix (`ray_hetspot_train_loss`, ...). `TensorBoardLog` writes the same
rows as scalars when `runtime.tensorboard_dir` is set.
"""

from __future__ import annotations

from planner.cost import model_flops_per_sample, plan_peak_flops
from planner.plan_types import Plan
from planner.specs import ModelSpec, tokens_per_step

GAUGES = {
    "loss": ("hetspot_train_loss", "training loss of the last committed step"),
    "val_loss": ("hetspot_validation_loss", "held-out loss of the last evaluation (train.eval_every)"),
    "tokens_per_s": ("hetspot_tokens_per_second", "tokens trained per second in the last step"),
    "mfu": ("hetspot_mfu", "model FLOPs utilisation against the plan's fleet peak"),
    "step_time_s": ("hetspot_step_time_seconds", "wall time of the last committed step"),
    "device_memory_bytes": ("hetspot_device_memory_bytes", "largest per-worker peak memory in the last step"),
    "step": ("hetspot_step", "index of the last committed step"),
    "restarts": ("hetspot_restarts", "re-plans after failures so far"),
    "upload_lag_steps": ("hetspot_upload_lag_steps", "committed steps since the newest step in S3 (jobs with S3)"),
}


STAGE_GAUGES = {
    "time_s": ("hetspot_stage_step_time_seconds", "a stage's compute time in the last step (its slowest TP rank)"),
    "memory_bytes": ("hetspot_stage_device_memory_bytes", "a stage's largest per-worker peak memory in the last step"),
}
STAGE_TAGS = ("job", "pipeline", "stage", "gpu_type", "node")
RECOVERY = ("hetspot_recovery_seconds", "a recovery: detection to the end of the first step after it (a drain: "
            "the training stall at its switch)")
RECOVERY_BUCKETS = [0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


def stage_series(row: dict) -> list[tuple[str, dict, float]]:
    """(metric key, tags, value) for each stage of a row (`row["stages"]`: plan_run.stage_rows)."""
    out = []
    for st in row.get("stages", []):
        tags = {k: str(st[k]) for k in ("pipeline", "stage", "gpu_type", "node")}
        out += [(key, tags, float(st[key])) for key in STAGE_GAUGES]
    return out


def recovery_seconds(events: list[dict], t_s: float) -> list[tuple[int, str, float]]:
    """(event index, kind, seconds) for each re-plan or drain whose first step after it ended by `t_s` (the
    controller's clock): a drain's training stall at its switch, else detection to `t_s`."""
    out = []
    for i, e in enumerate(events):
        if e.get("kind") == "drain" and e.get("stall_s") is not None:
            out.append((i, "drain", e["stall_s"]))
        elif e.get("kind") == "re-plan" and e.get("detected_s") is not None:
            out.append((i, "re-plan", max(0.0, t_s - e["detected_s"])))
    return out


def step_row(model: ModelSpec, plan: Plan, step: int, loss: float, step_time_s: float,
             device_memory_bytes: int, restarts: int, real_gpus: bool = True) -> dict:
    """One committed step's figures. MFU is None on fake GPUs (CPU compute against a GPU's peak means nothing)."""
    tokens_per_s = tokens_per_step(model, plan.global_batch) / step_time_s if step_time_s > 0 else 0.0
    flops_per_s = model_flops_per_sample(model) * plan.global_batch / step_time_s if step_time_s > 0 else 0.0
    mfu = flops_per_s / plan_peak_flops(plan) if real_gpus else None
    return {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "step_time_s": step_time_s, "device_memory_bytes": device_memory_bytes, "restarts": restarts}


def format_mfu(mfu: float | None) -> str:
    return "n/a (fake GPUs)" if mfu is None else f"{mfu:.1%}"


class StepMetrics:
    """The job's series: per-step gauges tagged `job`, per-stage gauges tagged with the stage's pipeline, stage,
    GPU type and node, and a histogram of recovery times tagged with their kind (docs/grafana-hetspot.json
    draws them)."""

    def __init__(self, job_id: str):
        from ray.util.metrics import Gauge, Histogram

        self.gauges: dict = {}
        self.stage_gauges: dict = {}
        self.observed: set = set()
        for key, (name, desc) in GAUGES.items():
            g = Gauge(name, description=desc, tag_keys=("job",))
            g.set_default_tags({"job": job_id})
            self.gauges[key] = g
        for key, (name, desc) in STAGE_GAUGES.items():
            g = Gauge(name, description=desc, tag_keys=STAGE_TAGS)
            g.set_default_tags({"job": job_id})
            self.stage_gauges[key] = g
        self.recovery = Histogram(RECOVERY[0], description=RECOVERY[1], boundaries=RECOVERY_BUCKETS,
                                  tag_keys=("job", "kind"))
        self.recovery.set_default_tags({"job": job_id})

    def record(self, row: dict) -> None:
        for key, g in self.gauges.items():
            if row.get(key) is not None:  # no MFU on fake GPUs, no upload lag without S3
                g.set(float(row[key]))
        for key, tags, value in stage_series(row):
            self.stage_gauges[key].set(value, tags=tags)

    def recoveries(self, events: list[dict], t_s: float) -> None:
        """Observe each recovery once, when the first step after it is committed (call after that step)."""
        for i, kind, seconds in recovery_seconds(events, t_s):
            if i not in self.observed:
                self.observed.add(i)
                self.recovery.observe(seconds, tags={"kind": kind})


class TensorBoardLog:
    """Scalars under train/ in a TensorBoard event file (tensorboardX, the `tensorboard` extra)."""

    def __init__(self, logdir: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise RuntimeError("runtime.tensorboard_dir needs tensorboardX: "
                               "pip install 'hetspot[tensorboard]'") from None
        self.writer = SummaryWriter(logdir=logdir)

    def record(self, row: dict) -> None:
        for key in ("loss", "tokens_per_s", "mfu", "step_time_s", "device_memory_bytes", "epoch"):
            if row.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", row[key], row["step"])
        if row.get("val_loss") is not None:
            self.writer.add_scalar("validation/loss", row["val_loss"], row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
