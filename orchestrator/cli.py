"""`hetspot` command line: parses arguments, calls orchestrator.api, prints tables or JSON.

User errors (HetspotError) print one paragraph to stderr and exit with their
code (2 for configuration), never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

import typer
from rich.console import Console

from orchestrator.errors import HetspotError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Elastic training on mixed spot GPUs.")
console = Console()
err_console = Console(stderr=True)


@app.callback()
def _root() -> None:
    """hetspot: plan, train and keep training on mixed, preemptible GPUs."""


def _user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HetspotError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@app.command()
@_user_errors
def plan(
    job_file: str = typer.Argument(..., help="job YAML with model:, train: and cluster:"),
    as_json: bool = typer.Option(False, "--json", help="print the plan, estimate and baselines as JSON"),
    objective: str = typer.Option("throughput", help="throughput, or cost ($ per million tokens)"),
) -> None:
    """Plan asymmetric DP/PP/TP for the job's cluster and compare with baselines."""
    from orchestrator import api
    from orchestrator.errors import ConfigError

    if objective not in ("throughput", "cost"):
        raise ConfigError(f"--objective {objective!r} must be 'throughput' or 'cost'")
    result = api.plan_file(job_file, objective)
    if as_json:
        _print_json(result)
    else:
        from orchestrator.render import plan_tables

        plan_tables(result, console)


@app.command()
@_user_errors
def submit(
    job_file: str = typer.Argument(..., help="job YAML"),
    plan_file: str | None = typer.Option(None, "--plan", help="a plan JSON (from `hetspot plan --json`) instead of planning"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="optimizer steps (default: the job's steps)"),
    as_json: bool = typer.Option(False, "--json", help="print plan, per-step losses, tokens/s and step times as JSON"),
) -> None:
    """Train the job on the embedded Ray test cluster described by its cluster: section."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from orchestrator import api
    from orchestrator.jobfile import load_job

    total = steps or load_job(job_file).steps
    quiet = as_json
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=err_console, disable=quiet)
    with progress:
        task = progress.add_task("train", total=total, info="starting")

        def on_status(msg: str) -> None:
            progress.update(task, info=msg)

        def on_step(s: int, loss: float, tok_s: float) -> None:
            progress.update(task, advance=1, info=f"step {s} loss {loss:.4f} {tok_s:,.0f} tok/s")

        result = api.submit_local(job_file, plan_file, steps, on_step=on_step, on_status=on_status)
    if as_json:
        _print_json(result)
    else:
        console.print(f"trained {len(result['losses'])} steps in {result['wall_s']:.1f} s: loss "
                      f"{result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s")


@app.command()
@_user_errors
def inventory(
    address: str | None = typer.Option(None, "--address", help="Ray GCS address of a running cluster (HOST:6379 or auto)"),
    job_file: str | None = typer.Option(None, "--job", help="show the embedded test cluster of this job file"),
    ec2_region: str | None = typer.Option(None, "--ec2-region", help="read EC2 facts for nodes with an instance id"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help="EC2 endpoint (default: AWS_ENDPOINT_URL or AWS)"),
    as_json: bool = typer.Option(False, "--json", help="print the discovered ClusterSpec and nodes as JSON"),
) -> None:
    """List the GPUs of a Ray cluster: type, count, market, zone, price."""
    from rich.table import Table

    from orchestrator import api

    result = api.inventory(address, job_file, ec2_region, endpoint_url)
    if as_json:
        _print_json(result)
        return
    t = Table(title="GPU inventory")
    for col in ("node", "GPUs", "type", "market", "zone", "instance", "$/h"):
        t.add_column(col)
    for n in result["nodes"]:
        t.add_row(n["name"], str(n["num_gpus"]), n["gpu_type"], n["market"], n["zone"] or "-",
                  n["instance_type"] or "-", f"{n['price_per_hour']:.2f}" if n["price_per_hour"] is not None else "-")
    console.print(t)
    console.print("total: " + ", ".join(f"{c}x {g}" for g, c in sorted(result["gpus_by_type"].items())))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
