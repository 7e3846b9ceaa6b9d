"""`hetspot drill` and `hetspot simulate` (registered by orchestrator/cli/main.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from orchestrator.cli.common import console, err_console
from orchestrator.cli.common import print_json as _print_json
from orchestrator.errors import ConfigError


def _emit(out: dict, as_json: bool, plot: Path | None, tables, draw) -> None:
    """The result as one JSON object or as tables, and the PNG when asked."""
    if plot is not None:
        draw(out, plot)
    if as_json:
        _print_json(out)
    else:
        tables(out, console)
        if plot is not None:
            console.print(f"plot: {plot}")


def drill(
    scenario: Path = typer.Argument(None, help="a drill file (see drills/); omit with --trace"),
    trace: Path = typer.Option(None, "--trace", help="replay a spot trace (Parcae JSON lines) instead"),
    time_scale: float = typer.Option(20.0, "--time-scale", help="trace seconds per drill second (20: 1 h in 3 min)"),
    nodes: int = typer.Option(6, "--nodes", help="test nodes a trace maps onto (GPU types cycle L4, T4, T4)"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    plot: Path = typer.Option(None, "--plot", help="write a PNG: both loss curves, faults, tokens/s over time"),
    reference: str = typer.Option("auto", "--reference", help="the run without faults: fixed (the first plan "
                                  "throughout), replayed (the drill's plans, step for step), auto (fixed for a "
                                  "scenario file, replayed for --trace)"),
) -> None:
    """Run a job on the embedded test cluster with faults injected, and hold it to a run without them.

    Exit 0 when the oracle holds (same losses to 1e-4, every sample once, the scenario's
    expectations met), 1 when it does not, 2 on bad input.
    """
    import logging

    from orchestrator.drills.report import _pyplot, drill_plot, drill_tables
    from orchestrator.drills.runner import REFERENCES, Drill

    if (scenario is None) == (trace is None):
        raise ConfigError("pass a scenario file (hetspot drill drills/preempt.yaml) or --trace FILE, not both")
    if reference not in ("auto", *REFERENCES):
        raise ConfigError(f"--reference {reference!r}: use auto, {', '.join(REFERENCES)}")
    if reference == "auto":
        reference = "fixed" if trace is None else "replayed"
    if plot is not None:
        _pyplot()  # the extra is missing: say so before minutes of training
        if plot.parent and not plot.parent.exists():
            raise ConfigError(f"--plot {plot}: the folder {plot.parent} does not exist")
    until = None
    if trace is not None:
        from orchestrator.drills.trace import load_trace, trace_scenario

        tr = load_trace(trace)
        sc, events = trace_scenario(tr, nodes, time_scale)
        until = tr.end_s / time_scale
        skipped = sum(e.kind == "skipped" for e in events)
        note = f"; {skipped} event(s) skipped (one node always stays up)" if skipped else ""
        err_console.print(f"replaying {trace} ({len(tr.events)} events, {tr.end_s / 60:.0f} min) in {until:.0f} s on "
                          f"{nodes} test nodes{note}", highlight=False)
    else:
        from orchestrator.drills.scenario import load_scenario

        sc = load_scenario(scenario)
    logging.getLogger("hetspot").setLevel(logging.ERROR)
    # progress on stderr in both modes: --json keeps stdout to the one object
    result = Drill(sc, on_line=lambda m: err_console.print(f"[dim]{m}[/]", highlight=False),
                   reference=reference).run(until_s=until)
    out = result.to_json()
    if trace is not None:
        out["trace"] = {"file": str(trace), "time_scale": time_scale, "nodes": nodes,
                        "events": [e.__dict__ for e in events]}
    _emit(out, as_json, plot, drill_tables, drill_plot)
    raise typer.Exit(0 if result.oracle_holds else 1)


def simulate(
    trace: Path = typer.Option(..., "--trace", help="a spot trace (Parcae JSON lines)"),
    cluster: Path = typer.Option(..., "--cluster", help="the fleet: nodes: or fleet: groups (examples/fleets/)"),
    model: str = typer.Option("7b", "--model", help="a model preset (7b, 70b, llama-8b, ...)"),
    global_batch: int = typer.Option(1024, "--global-batch", min=1, max=65536),
    detect_s: float = typer.Option(None, "--detect-s", help="seconds to detect a lost node (default: measured)"),
    startup_s: float = typer.Option(None, "--startup-s", help="seconds from a worker process start to ready "
                                    "(default 13: a gpt-1.3b stage's cold start on an H200, measured; the CPU "
                                    "test cluster measures 4.3)"),
    reform_s: float = typer.Option(None, "--reform-s", help="seconds for survivors to re-form their groups in place "
                                   "(default: measured on the test cluster)"),
    recovery: str = typer.Option(None, "--recovery", help="hetspot's recovery (runtime.recovery): in-place, the "
                                 "default, or restart"),
    warm_at_join: bool = typer.Option(True, "--warm-at-join/--no-warm-at-join", help="in place, a joined node's "
                                      "workers start at the join (as the controller does); off: at the move"),
    ckpt_every_min: float = typer.Option(30.0, "--ckpt-every-min", help="s3-only's checkpoint interval"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object on stdout"),
    plot: Path = typer.Option(None, "--plot", help="write a PNG: tokens/s and tokens trained over the trace"),
    jobs: Path = typer.Option(None, "--jobs", help="a jobs file (examples/jobs/): several jobs arriving on the "
                              "fleet, their models and work from the file; first come first served against the "
                              "weighted-throughput share"),
) -> None:
    """Replay a spot trace against the planner and cost model at fleet scale (no Ray): hetspot's recovery
    against a free re-plan oracle (and one that pays joined nodes' start-up), S3-only checkpoint-restart and a
    symmetric plan. With --jobs: several jobs on one fleet, first come first served against the fleet's share
    chosen for weighted throughput."""
    from orchestrator.drills.fleet import Assumptions, FleetSim
    from orchestrator.drills.report import _pyplot, simulate_plot, simulate_tables
    from orchestrator.drills.trace import load_fleet, load_trace
    from orchestrator.state.recovery import STRATEGIES, InPlace
    from planner.specs import PRESETS, ModelSpec, TrainSpec

    if model.lower() not in PRESETS:
        raise ConfigError(f"--model {model!r}: not a preset; use one of {', '.join(PRESETS)}")
    for name, v in (("--detect-s", detect_s), ("--startup-s", startup_s), ("--reform-s", reform_s)):
        if v is not None and not 0 <= v <= 3600:
            raise ConfigError(f"{name} {v}: give seconds from 0 to 3600")
    recovery = recovery or InPlace.name
    if recovery not in STRATEGIES:
        raise ConfigError(f"--recovery {recovery!r}: give {' or '.join(STRATEGIES)}")
    if not 1 <= ckpt_every_min <= 24 * 60:
        raise ConfigError(f"--ckpt-every-min {ckpt_every_min}: give minutes from 1 to 1440")
    if plot is not None:
        _pyplot()
    tr = load_trace(trace)
    fleet = load_fleet(cluster)
    a = Assumptions(ckpt_every_s=ckpt_every_min * 60, recovery=recovery, warm_at_join=warm_at_join)
    for name, v in (("detect_s", detect_s), ("startup_s", startup_s), ("reform_s", reform_s)):
        if v is not None:
            setattr(a, name, v)
    by_type: dict[str, int] = {}
    for n in fleet.nodes:
        by_type[n.gpu_type] = by_type.get(n.gpu_type, 0) + n.num_gpus
    fleet_info = {"file": str(cluster), "gpus": fleet.num_gpus, "nodes": len(fleet.nodes),
                  "mix": ", ".join(f"{c}x {g}" for g, c in by_type.items())}
    if jobs is not None:
        from orchestrator.drills.jobs_sim import JobsSim, load_jobs
        from orchestrator.drills.report import jobs_tables

        if plot is not None:
            raise ConfigError("--plot: not drawn with --jobs; leave it out")
        out = JobsSim(tr, fleet, load_jobs(jobs), a).run() | {"trace": str(trace), "jobs_file": str(jobs),
                                                               "fleet": fleet_info}
        _emit(out, as_json, None, jobs_tables, None)
        return
    spec = ModelSpec.preset(model)
    result = FleetSim(tr, fleet, spec, TrainSpec(global_batch=global_batch), a).run()
    result |= {"trace": str(trace), "model": spec.name, "global_batch": global_batch, "fleet": fleet_info}
    _emit(result, as_json, plot, simulate_tables, simulate_plot)
