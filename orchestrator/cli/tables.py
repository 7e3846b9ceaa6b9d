"""Rich tables for people (the `--json` output is the machine form of the same data)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from orchestrator.numbers import num
from planner.catalog import gpu_info
from planner.plan_types import OffloadPolicy


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _layers(st: dict[str, Any], i: int, num_stages: int) -> str:
    """A stage's layers; a stage with none holds the embedding (the first) or the LM head (the last) alone."""
    if st["layer_end"] > st["layer_start"]:
        return f"{st['layer_start']}-{st['layer_end'] - 1}"
    return "none: embedding only" if i == 0 else "none: LM head only" if i == num_stages - 1 else "none"


def _whole_words(t: Table, console: Console) -> Table:
    """A table wider than the terminal (80 columns, say) gets column widths of its own: each column at least as
    wide as its longest word (header included), the room left shared in proportion to what each column would
    take more, so cells wrap between words and a name (an instance type, a GPU type, a node) is never broken
    in the middle. Only where the words alone do not fit does rich fold them."""
    cells = [[c for c in [col.header, *col.cells] if isinstance(c, str)] for col in t.columns]
    least = [max((len(w) for c in cs for w in c.split()), default=1) for cs in cells]
    most = [max((len(line) for c in cs for line in c.splitlines()), default=1) for cs in cells]
    room = console.width - 3 * len(t.columns) - 1  # each column's padding and rule, and the last rule
    if sum(most) <= room or sum(least) > room:
        return t
    extra, want = room - sum(least), [m - n for m, n in zip(most, least, strict=True)]
    for col, n, w in zip(t.columns, least, want, strict=True):
        col.width = n + extra * w // sum(want)
    return t


def fleet_table(fleet: dict[str, Any], console: Console) -> None:
    """`plan --fleet auto`: the chosen fleet beside the next best two and the best single-type fleet."""
    budget = f", budget ${fleet['budget_per_hour']:g}/h" if fleet.get("budget_per_hour") else ""
    t = Table(title=f"Fleet: chosen for {'$ per M tokens' if fleet['objective'] == 'cost' else 'tokens/s'}{budget} "
                    f"({fleet['fleets_planned']} of {fleet['fleets_within_limits']} fleets planned)")
    floor = f", at least {fleet['min_tokens_per_s']:,.0f} tokens/s" if fleet.get("min_tokens_per_s") else ""
    t.title += floor
    for col in ("", "instances", "$/h", "tokens/s", "delivered", "$ per M tokens", "time lost"):
        t.add_column(col, overflow="fold")
    for o in fleet["options"]:
        t.add_row(o["label"], " + ".join(f"{x['nodes']}x {x['type']}" for x in o["fleet"]),
                  f"{o['price_per_hour']:.2f}", f"{o['tokens_per_s']:,.0f}", f"{o['effective_tokens_per_s']:,.0f}",
                  _usd(o["cost_per_mtok"]), num(o["preemption_loss"], ".1%"))
    console.print(_whole_words(t, console))
    console.print("delivered: tokens/s after the expected preemptions; time lost: the share of time they cost")


def plan_tables(result: dict[str, Any], console: Console) -> None:
    plan, est = result["plan"], result["estimate"]
    model = result["model"]
    console.print(
        f"[bold]{result['job']}[/]: model {model['name']} ({model['num_params'] / 1e6:,.1f}M params, "
        f"{model['num_layers']} layers), global batch {plan['global_batch']}"
    )
    t = Table(title="Plan: pipelines (data-parallel replicas) and stages; micro-batches as n x samples",
              show_lines=False)
    for col in ("pipe", "samples", "micro-batches", "stage", "GPUs @ node", "layers", "GiB / cap", "offload"):
        t.add_column(col, overflow="fold")  # a narrow terminal or a pipe folds a cell, never cuts it
    mem = est["memory_gib"]
    reasons: list[str] = []  # offload reasons, as numbered notes under the table
    for r, p in enumerate(plan["pipelines"]):
        for i, st in enumerate(p["stages"]):
            cap = gpu_info(st["gpu_type"]).mem_gib
            first = i == 0  # replica-level columns only on its first row
            t.add_row(
                str(r) if first else "",
                str(p["num_samples"]) if first else "",
                f"{p['num_micro_batches']} x {p['micro_batch_size']}" if first else "",  # count x size
                str(i),
                f"{len(st['devices'])}x {st['gpu_type']}\n{st['node']}",
                _layers(st, i, len(p["stages"])),
                f"{mem[st['devices'][0]]:.1f} / {cap:.0f}",
                _offload(st["offload"], st["layer_end"] - st["layer_start"], reasons),
            )
    console.print(_whole_words(t, console))
    for k, why in enumerate(reasons, 1):
        console.print(f"[{k}] {why}", highlight=False)
    if plan["unused"]:
        by_reason: dict[str, list[str]] = {}
        for u in plan["unused"]:
            by_reason.setdefault(u["reason"], []).append(u["device"])
        console.print(f"[yellow]{len(plan['unused'])} device(s) unused[/]: " + "; ".join(
            ", ".join(devs[:6]) + (f" and {len(devs) - 6} more" if len(devs) > 6 else "") + f": {why}"
            for why, devs in by_reason.items()))
    line = (f"[bold]Estimate[/]: step {_fmt_time(est['step_time_s'])}, {est['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {num(est['mfu'], '.1%')}, bottleneck: {est['bottleneck']}")
    if est.get("cost_per_mtok") is not None:
        line += f", ${est['cost_per_mtok']:.4f} per M tokens"
    if est.get("preemption_loss"):
        line += f" (expected preemptions cost {num(est['preemption_loss'], '.1%')} of the time)"
    console.print(line)
    b = Table(title="Against baselines (same cost model)")
    if result.get("objective") == "cost":  # what the objective weighs: $ per million tokens
        for col in ("plan", "$ per M tokens", "tokens/s", "hetspot saves"):
            b.add_column(col, overflow="fold")
        b.add_row("hetspot", _usd(est.get("cost_per_mtok")), f"{est['tokens_per_s']:,.0f}", "1.00x")
        for name, bl in result["baselines"].items():
            if bl is None:
                b.add_row(name, "does not fit", "-", "-")
            else:
                e, ratio = bl["estimate"], bl.get("cost_ratio")
                b.add_row(name, _usd(e.get("cost_per_mtok")), f"{e['tokens_per_s']:,.0f}",
                          f"{ratio:.2f}x" if ratio is not None else "-")
        console.print(_whole_words(b, console))
        return
    for col in ("plan", "tokens/s", "step", "hetspot speedup"):
        b.add_column(col, overflow="fold")
    b.add_row("hetspot", f"{est['tokens_per_s']:,.0f}", _fmt_time(est["step_time_s"]), "1.00x")
    for name, bl in result["baselines"].items():
        if bl is None:
            b.add_row(name, "does not fit", "-", "-")
        else:
            e = bl["estimate"]
            b.add_row(name, f"{e['tokens_per_s']:,.0f}", _fmt_time(e["step_time_s"]), f"{bl['speedup']:.2f}x")
    console.print(_whole_words(b, console))


def _usd(v: float | None) -> str:
    return f"${v:.4f}" if v is not None else "-"


def _offload(pol: dict[str, Any], layers: int, reasons: list[str]) -> str:
    """Compact: `rc 13/24 · opt→host · params→host (pf 1) [2]`; the reason goes to note [2] under the table."""
    policy = OffloadPolicy.model_validate(pol)
    parts = [f"rc {len(policy.recompute_layers)}/{layers}"] if policy.recompute_layers else []
    parts += ["opt→host"] if policy.offload_optimizer else []
    parts += [f"params→host (pf {policy.prefetch_depth})"] if policy.offload_params else []
    if not parts:
        return "none"
    if policy.reason:
        if policy.reason not in reasons:
            reasons.append(policy.reason)
        parts.append(f"[{reasons.index(policy.reason) + 1}]")
    return " · ".join(parts)


def print_status(ref: str, st: dict, console: Console) -> None:
    """`hetspot status`: state, newest step, S3, summary and ETA (from a run record), events, and with --history
    every committed step."""
    from orchestrator.runtime.metrics import format_mfu

    console.print(f"[bold]{ref}[/]: {st['status']}" + (f" ({st['message']})" if st.get("message") else ""))
    p, summ = st.get("progress"), st.get("summary")
    if st.get("phase"):
        console.print(f"  phase: {st['phase']}")
    if p:
        # a driver's row names the job's length; a run record's row does not (its summary does)
        total = p.get("steps") or ((summ or {}).get("committed_steps", 0) + (summ or {}).get("steps_left", 0)) or None
        of = f"/{total}" if total else ""
        console.print(f"  step {p['step'] + 1}{of}: loss {p['loss']:.4f}, {p.get('tokens_per_s', 0):,.0f} tokens/s, "
                      f"MFU {format_mfu(p.get('mfu'))}, step {p.get('step_time_s', 0):.2f} s, "
                      f"{p.get('restarts', 0)} re-plans")
        if p.get("val_loss") is not None:
            console.print(f"  validation loss {p['val_loss']:.4f} (held-out data, after step {p['step'] + 1})")
        if p.get("epoch") is not None:  # epochs done: the whole ones and the fraction of the current one
            whole = int(p["epoch"])
            console.print(f"  data: epoch {whole + 1}, {(p['epoch'] - whole) * 100:.1f}% of it read "
                          f"({p['epoch']:.3f} epochs done)")
        if p.get("peer_step") is not None:
            console.print(f"  peer copies: step {p['peer_step']} ({p['step'] - p['peer_step']} steps old)")
        if "upload_lag_steps" in p:
            s3 = "none yet" if p["s3_step"] is None else f"step {p['s3_step']}"
            console.print(f"  S3: newest {s3}, {p['upload_lag_steps']} steps behind, {p['upload_backlog']} "
                          f"upload(s) in flight or waiting, {p['failed_uploads']} failed")
            if p.get("s3_no_access"):
                console.print(f"  S3: no write access from {', '.join(p['s3_no_access'])}: their uploads fail "
                              "(give those nodes credentials that may write the bucket)")
    else:
        console.print("  no step committed yet")
    if summ:
        eta = f", ETA {summ['eta_s']:.0f} s" if summ.get("eta_s") is not None else ""
        goodput = f"{summ['goodput'] * 100:.1f}%" if summ.get("goodput") is not None else "-"
        console.print(f"  {summ['committed_steps']} steps committed, {summ['steps_left']} left{eta}; "
                      f"goodput {goodput}, "
                      f"{summ['recovering_s']:.1f} s recovering over {summ['re_plans']} re-plans and {summ['drains']} "
                      f"drains, {summ['lost_steps']} steps redone")
    if st.get("run_record"):
        console.print(f"  run record: {st['run_record']}", highlight=False, soft_wrap=True)
    for e in st.get("events", []):
        times = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in e.items()
                          if k.endswith("_s") and isinstance(v, int | float))
        tiers = ", ".join(f"{t} {n / 2**20:.1f} MiB" for t, n in e.get("bytes_by_tier", {}).items())
        console.print(f"  {e['kind']} at step {e['at_step']}: {e['cause']}" + (f" ({times})" if times else "")
                      + (f"; restored bytes: {tiers}" if tiers else ""))
        if isinstance(e.get("plan_choice"), dict) and e["plan_choice"].get("choice"):  # a re-plan's trade
            console.print(f"    chose {e['plan_choice']['choice']}", highlight=False, soft_wrap=True)
    if "history" in st:
        t = Table(title="committed steps")
        held_out = any(r.get("val_loss") is not None for r in st["history"])
        for col in ("step", "loss", *(["validation loss"] if held_out else []), "tokens/s", "step s", "at s"):
            t.add_column(col, justify="right")
        for r in st["history"]:
            val = [f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else ""] if held_out else []
            t.add_row(str(r["step"]), f"{r['loss']:.4f}", *val, f"{r.get('tokens_per_s', 0):,.0f}",
                      f"{r.get('step_time_s', 0):.2f}", f"{r['t_s']:.1f}")
        console.print(t)
