"""`hetspot checkpoints list|verify|rm URI`: a job's S3 steps (registered as a sub-app by orchestrator/cli.py)."""

from __future__ import annotations

import json
import sys

import typer

checkpoints_app = typer.Typer(no_args_is_help=True, help="A job's checkpoints in S3: list, verify, delete.")
URI_HELP = "the job's checkpoint.uri, s3://BUCKET/PREFIX"
ENDPOINT_HELP = "S3 endpoint (default: AWS_ENDPOINT_URL, else AWS)"


def _store(uri: str, endpoint_url: str | None):
    from orchestrator.errors import ConfigError
    from orchestrator.state.s3_store import check_access

    try:
        return check_access(uri, endpoint_url)
    except ValueError as e:
        raise ConfigError(str(e).replace("checkpoint.uri", "URI").replace("checkpoint.endpoint_url", "--endpoint-url")) from None


def list_steps(
    uri: str = typer.Argument(..., help=URI_HELP),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the steps as JSON"),
) -> None:
    """Steps under URI, newest first: complete (a manifest exists) or not, objects and bytes."""
    rows = [{"step": i.step, "complete": i.complete, "objects": i.num_objects, "bytes": i.nbytes}
            for i in _store(uri, endpoint_url).steps()]
    if as_json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"checkpoints in {uri}")
    for col in ("step", "state", "objects", "MiB"):
        t.add_column(col)
    for r in rows:
        t.add_row(str(r["step"]), "complete" if r["complete"] else "incomplete (no manifest: ignored)",
                  str(r["objects"]), f"{r['bytes'] / 2**20:.2f}")
    Console().print(t)


def verify(
    uri: str = typer.Argument(..., help=URI_HELP),
    step: int | None = typer.Option(None, "--step", help="one step (default: every complete step)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Re-read every object of each complete step against its SHA256 in the manifest. Exit 1 if one fails."""
    store = _store(uri, endpoint_url)
    steps = [step] if step is not None else store.complete_steps()
    result = {s: store.verify(s) for s in steps}
    if as_json:
        sys.stdout.write(json.dumps([{"step": s, "ok": not p, "problems": p} for s, p in result.items()], indent=2) + "\n")
    else:
        for s, problems in result.items():
            typer.echo(f"step {s}: " + ("ok" if not problems else "BAD: " + "; ".join(problems)))
    if any(result.values()):
        raise typer.Exit(1)


def rm(
    uri: str = typer.Argument(..., help=URI_HELP),
    step: int | None = typer.Option(None, "--step", help="the step to delete"),
    all_steps: bool = typer.Option(False, "--all", help="delete every step under URI"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
) -> None:
    """Delete one step (--step N) or all of them (--all); a step's manifest goes first."""
    from orchestrator.errors import ConfigError

    if (step is None) == (not all_steps):
        raise ConfigError("give exactly one of --step N or --all")
    store = _store(uri, endpoint_url)
    steps = [i.step for i in store.steps()] if all_steps else [step]
    if step is not None and step not in [i.step for i in store.steps()]:
        raise ConfigError(f"no step {step} under {uri}; `hetspot checkpoints list {uri}` shows the steps")
    n = sum(store.delete_step(s) for s in steps)
    typer.echo(f"deleted {len(steps)} step(s), {n} object(s)")
