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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
