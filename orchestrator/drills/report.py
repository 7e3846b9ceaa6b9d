"""Drill and simulation results for people: rich tables, and a PNG (matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from orchestrator.errors import ConfigError
from orchestrator.numbers import num

REFERENCE_KINDS = {"fixed": "the first plan throughout", "replayed": "the drill's plans, without faults"}


def _s(x) -> str:
    return "-" if x is None else num(x, ".2f")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "0"


def drill_tables(r: dict, console: Console) -> None:
    verdict = "[bold green]oracle holds[/]" if r["oracle_holds"] else "[bold red]oracle FAILS[/]"
    console.print(f"[bold]drill {r['name']}[/]: {verdict}" + (f" ({r['error']})" if r["error"] else ""))
    f = Table(title="Faults injected", show_lines=False)
    for col in ("fault", "nodes", "when", "at (s)", "detail"):
        f.add_column(col, overflow="fold")
    for x in r["faults"]:
        when = f"step {x['at_step']}" if x.get("at_step") is not None else f"{x['at_s']:.1f} s"
        detail = ", ".join(f"{k} {v}" for k, v in x.items() if k in ("cloud", "deadline_s", "for_s", "damaged_step",
                                                                          "upload_step"))
        f.add_row(x["kind"], ", ".join(x["nodes"]) or "-", when, _s(x["injected_s"]), detail or "-")
    console.print(f)
    t = Table(title="Recoveries (seconds since the job started)")
    for col in ("event", "after step", "detect", "re-plan", "restore", "1st step", "from step", "bytes"):
        t.add_column(col, overflow="fold")
    for x in r["recoveries"]:
        tiers = x["bytes_by_tier"] or {}
        src = ", ".join(f"{k} {_mib(v)}" for k, v in tiers.items() if v) or ("-" if not tiers else "nothing lost")
        step = "-" if x["restore_step"] is None else f"step {x['restore_step']}"
        t.add_row(x["kind"], str(x["at_step"]), _s(x["detected_s"]), _s(x["replanned_s"]), _s(x["restored_s"]),
                  _s(x["first_step_s"]), step, src)
    console.print(t)
    s = r["samples"]
    tiers = ", ".join(f"{k} {_mib(v)}" for k, v in r["bytes_by_tier"].items())
    console.print(f"losses: {sum(v is not None for v in r['losses'])} of {r['steps']} steps, largest relative "
                  f"difference from the reference run {r['max_rel_diff']:.2e} (limit 1e-4; reference: "
                  f"{REFERENCE_KINDS.get(r.get('reference_kind'), 'the first plan throughout')})")
    console.print(f"samples: {s['seen']} of {s['expected']} seen, {s['missing']} missing, {s['repeated']} repeated"
                  f"{'' if s['exactly_once'] else ' [red](not exactly once)[/]'}")
    console.print(f"restored by tier: {tiers}; lost (redone) steps: {r['lost_steps']}; failed uploads: "
                  f"{r['failed_uploads']}")
    lag = r.get("upload_lag") or {}
    if lag:
        console.print(f"S3 uploads: newest step {lag['newest_step']}, at most {lag['max_lag_steps']} steps behind and "
                      f"{lag['max_backlog']} in flight or waiting at a commit, {lag['dropped']} dropped for a newer "
                      "step")
    console.print(f"goodput: {num(r['goodput'], '.1%')} (useful step time {num(r['useful_s'], '.1f')} s of "
                  f"{num(r['wall_s'], '.1f')} s)")
    for bad in r["expect_failures"]:
        console.print(f"[red]expectation not met[/]: {bad}")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hetspot\\[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def drill_plot(r: dict, path: str | Path) -> None:
    """Both loss curves with the faults marked, and tokens/s over wall time with faults and recoveries."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    steps = list(range(r["steps"]))
    same = ", the drill's plans" if r.get("reference_kind") == "replayed" else ""
    a.plot(steps, r["reference_losses"], "-", color="0.6", lw=3, label=f"reference (no faults{same})")
    got = [(s, x) for s, x in zip(steps, r["losses"], strict=True) if x is not None]
    a.plot([s for s, _ in got], [x for _, x in got], "o", ms=4, color="tab:blue", label="drill")
    kinds: set[str] = set()
    for x in r["faults"]:
        at = x["committed"] + 1
        a.axvline(at, color="tab:red", ls="--", lw=1, label=None if "fault" in kinds else "fault injected")
        kinds.add("fault")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title(f"drill {r['name']}: losses (largest relative difference {r['max_rel_diff']:.1e})")
    a.legend(loc="upper right")
    pts = r["tokens_per_s"]
    b.plot([p["t_s"] for p in pts], [p["tokens_per_s"] for p in pts], "o", ms=3, color="tab:blue",
           label="tokens/s of each committed step")
    for x in r["recoveries"]:  # from detection to the first step after it: no training
        if x["first_step_s"] is not None:
            b.axvspan(x["detected_s"], x["first_step_s"], color="tab:orange", alpha=0.2,
                      label=None if "span" in kinds else "recovering")
            kinds.add("span")
    for x in r["faults"]:
        b.axvline(x["injected_s"], color="tab:red", ls="--", lw=1, label=None if "f2" in kinds else "fault injected")
        kinds.add("f2")
    for x in r["recoveries"]:
        if x["first_step_s"] is not None:
            b.axvline(x["first_step_s"], color="tab:green", ls=":", lw=1.5,
                      label=None if "rec" in kinds else "first step after recovery")
            kinds.add("rec")
    b.set_xlabel("seconds since the job started")
    b.set_ylabel("tokens/s")
    b.set_ylim(bottom=0)
    b.set_title(f"throughput; goodput {r['goodput'] * 100:.1f}%")
    b.legend(loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_plot(record: dict, rows: list[dict], path: str | Path) -> None:
    """A job's run record: loss per step (and the validation loss where it was evaluated), and tokens/s over
    wall time with its recoveries as bands (a re-plan from its detection to the first step after it; a drain over
    its switch), as the drill plots draw them."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    a.plot([r["step"] for r in rows], [r["loss"] for r in rows], "o-", ms=3, color="tab:blue", label="loss")
    held_out = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if held_out:  # train.eval_every: the validation loss after those steps
        a.plot(*zip(*held_out, strict=True), "s-", ms=4, color="tab:green", label="validation loss")
    kinds: set[str] = set()
    for e in record["events"]:
        if e.get("kind") in ("re-plan", "drain", "scale-up"):
            a.axvline(e["at_step"] + 1, color="tab:red", ls="--", lw=1,
                      label=None if "ev" in kinds else "re-plan or drain")
            kinds.add("ev")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    a.set_title(f"{record['job_id']}: {record['state']}, {len(rows)} steps committed")
    a.legend(loc="upper right")
    b.plot([r["t_s"] for r in rows], [r.get("tokens_per_s", 0) for r in rows], "o", ms=3, color="tab:blue",
           label="tokens/s of each committed step")
    for e in record["events"]:
        if e.get("kind") not in ("re-plan", "drain"):
            continue
        start = e.get("switch_s", e.get("detected_s", e["t_s"]))
        end = next((r["t_s"] for r in rows if r["t_s"] > e["t_s"]), None)
        if end is not None:
            b.axvspan(start, end, color="tab:orange", alpha=0.2, label=None if "span" in kinds else "recovering")
            kinds.add("span")
    b.set_xlabel("seconds since the job started")
    b.set_ylabel("tokens/s")
    b.set_ylim(bottom=0)
    goodput = record["summary"].get("goodput")
    b.set_title("throughput" + (f"; goodput {goodput * 100:.1f}%" if goodput is not None else ""))
    b.legend(loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulate_tables(r: dict, console: Console) -> None:
    console.print(f"[bold]simulate[/] {r['trace']} on {r['fleet']['gpus']} GPUs ({r['fleet']['mix']}), model "
                  f"{r['model']}: {r['events']} events over {r['hours']:.2f} h")
    t = Table(title="Tokens trained over the trace")
    for col in ("strategy", "tokens (B)", "vs oracle", "goodput", "re-plans", "down s", "lost work s"):
        t.add_column(col, overflow="fold", no_wrap=col == "strategy")  # a name whole, never broken mid-word
    oracle = r["strategies"]["oracle"]["tokens"] or 1.0
    for name, s in r["strategies"].items():
        t.add_row(name, num(s["tokens"] / 1e9, ".3f"), num(s["tokens"] / oracle, ".1%"), num(s["goodput"], ".1%"),
                  str(s["recoveries"]), num(s["down_s"], ".0f"), num(s["lost_s"], ".0f"))
    console.print(t)
    console.print("assumptions: " + "; ".join(f"{k} {v}" for k, v in r["assumptions"].items()), highlight=False)
    console.print(f"simulated in {r['sim_s']:.1f} s")


def jobs_tables(r: dict, console: Console) -> None:
    console.print(f"[bold]simulate --jobs[/] {r['jobs_file']}: {len(r['policies']['fcfs']['jobs'])} jobs on "
                  f"{r['fleet']['gpus']} GPUs ({r['fleet']['mix']}), trace {r['trace']}: {r['events']} events over "
                  f"{r['hours']:.2f} h")
    t = Table(title="The fleet's share: first come first served against the weighted-throughput share")
    for col in ("policy", "weighted goodput", "vs fcfs", "goodput", "finished", "weighted JCT min", "moves"):
        t.add_column(col, overflow="fold", no_wrap=col == "policy")
    base = r["policies"]["fcfs"]["weighted_goodput"] or 1.0
    for name, p in r["policies"].items():
        jct = "-" if p["weighted_jct_min"] is None else num(p["weighted_jct_min"], ".1f")
        t.add_row(name, num(p["weighted_goodput"], ".3f"), num(p["weighted_goodput"] / base, ".2f") + "x",
                  num(p["goodput"], ".3f"), str(p["finished"]), jct, str(p["moves"]))
    console.print(t)
    j = Table(title="Each job: share of its work done (completion, minutes waited with no GPU)")
    j.add_column("job", no_wrap=True)
    j.add_column("prio")
    for name in r["policies"]:
        j.add_column(name, overflow="fold")
    for job, row in r["policies"]["fcfs"]["jobs"].items():
        cells = []
        for p in r["policies"].values():
            x = p["jobs"][job]
            end = f"done at {x['finished_min']:.0f} min" if x["finished_min"] is not None else f"{x['done']:.0%}"
            cells.append(f"{end}, waited {x['waited_min']:.0f}")
        j.add_row(job, str(row["priority"]), *cells)
    console.print(j)
    console.print("assumptions: " + "; ".join(f"{k} {v}" for k, v in r["assumptions"].items()) +
                  f"; hysteresis {r['hysteresis']:.0%}", highlight=False)
    console.print(f"simulated in {r['sim_s']:.1f} s ({r['plans']} plans)")


def simulate_plot(r: dict, path: str | Path) -> None:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    for name, s in r["strategies"].items():
        xs = [p[0] / 60 for p in s["timeline"]]
        a.step(xs, [p[1] / 1e3 for p in s["timeline"]], where="post", label=name)
        b.plot(xs, [p[2] / 1e9 for p in s["timeline"]], label=name)
    for t_s, kind in r["event_times"]:
        a.axvline(t_s / 60, color="tab:red" if kind == "remove" else "tab:green", ls=":", lw=0.8)
    a.set_ylabel("tokens/s (thousands)")
    a.set_title(f"{r['model']} on {r['fleet']['gpus']} GPUs: throughput (red: preemptions, green: joins)")
    a.legend(loc="lower left")
    b.set_xlabel("minutes into the trace")
    b.set_ylabel("tokens trained (billions)")
    b.legend(loc="upper left")
    fig.savefig(path, dpi=110)
    plt.close(fig)
