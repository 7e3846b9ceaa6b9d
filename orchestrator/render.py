"""Rich tables for people (the `--json` output is the machine form of the same data)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from planner.catalog import gpu_info
from planner.plan_types import OffloadPolicy


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def plan_tables(result: dict[str, Any], console: Console) -> None:
    plan, est = result["plan"], result["estimate"]
    model = result["model"]
    console.print(
        f"[bold]{result['job']}[/]: model {model['name']} ({model['num_params'] / 1e6:,.1f}M params, "
        f"{model['num_layers']} layers), global batch {plan['global_batch']}"
    )
    t = Table(title="Plan: pipelines (data-parallel replicas) and stages", show_lines=False)
    for col in ("pipe", "samples", "micro-batches", "stage", "GPUs", "layers", "memory / capacity", "offload"):
        t.add_column(col)
    mem = est["memory_gib"]
    for r, p in enumerate(plan["pipelines"]):
        for i, st in enumerate(p["stages"]):
            cap = gpu_info(st["gpu_type"]).mem_gib
            first = i == 0  # replica-level columns only on its first row
            t.add_row(
                str(r) if first else "",
                str(p["num_samples"]) if first else "",
                f"{p['num_micro_batches']} x {p['micro_batch_size']}" if first else "",
                str(i),
                f"{len(st['devices'])}x {st['gpu_type']} @ {st['node']}",
                f"{st['layer_start']}-{st['layer_end'] - 1}",
                f"{mem[st['devices'][0]]:.1f} / {cap:.0f} GiB",
                _offload(st["offload"]),
            )
    console.print(t)
    if plan["unused"]:
        console.print(f"[yellow]{len(plan['unused'])} device(s) unused[/]: " + "; ".join(
            f"{u['device']}: {u['reason']}" for u in plan["unused"][:6]) + (" ..." if len(plan["unused"]) > 6 else ""))
    line = (f"[bold]Estimate[/]: step {_fmt_time(est['step_time_s'])}, {est['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {est['mfu'] * 100:.1f}%, bottleneck: {est['bottleneck']}")
    if est.get("cost_per_mtok") is not None:
        line += f", ${est['cost_per_mtok']:.3f} per M tokens"
    console.print(line)
    b = Table(title="Against baselines (same cost model)")
    for col in ("plan", "tokens/s", "step", "hetspot speedup"):
        b.add_column(col)
    b.add_row("hetspot", f"{est['tokens_per_s']:,.0f}", _fmt_time(est["step_time_s"]), "1.00x")
    for name, bl in result["baselines"].items():
        if bl is None:
            b.add_row(name, "does not fit", "-", "-")
        else:
            e = bl["estimate"]
            b.add_row(name, f"{e['tokens_per_s']:,.0f}", _fmt_time(e["step_time_s"]), f"{bl['speedup']:.2f}x")
    console.print(b)


def _offload(pol: dict[str, Any]) -> str:
    policy = OffloadPolicy.model_validate(pol)
    desc = policy.describe()
    return f"{desc} ({policy.reason})" if policy.reason and desc != "none" else desc
