"""`hetspot checkpoints list|verify|rm|export URI`: a job's S3 steps (registered as a sub-app by orchestrator/cli/main.py)."""

from __future__ import annotations

import json
import sys

import typer

checkpoints_app = typer.Typer(no_args_is_help=True, help="A job's checkpoints in S3: list, verify, delete, export.")
URI_HELP = "the job's checkpoint.uri, s3://BUCKET/PREFIX"
ENDPOINT_HELP = "S3 endpoint (default: AWS_ENDPOINT_URL, else AWS)"


def _store(uri: str, endpoint_url: str | None):
    from orchestrator.errors import ConfigError
    from orchestrator.state.s3_store import check_access

    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint-url {endpoint_url!r} must be an http:// or https:// URL (or leave it out: "
                          "AWS_ENDPOINT_URL, else AWS)")
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
    if not rows:
        typer.echo(f"no steps under {uri}/ (a job writes them when its checkpoint.uri is this prefix)")
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
    """Check each complete step: its manifest covers the whole model, and every object re-read matches its
    SHA256 in the manifest. Exit 1 if one fails."""
    from orchestrator.errors import ConfigError

    store = _store(uri, endpoint_url)
    complete = store.complete_steps()
    if step is not None and step not in complete:
        raise ConfigError(f"no complete step {step} under {uri}/; `hetspot checkpoints list {uri}` shows its steps")
    steps = [step] if step is not None else complete
    if not steps and not as_json:
        typer.echo(f"no complete steps under {uri}/: nothing to verify")
        return
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
    yes: bool = typer.Option(False, "--yes", "-y", help="delete without asking (needed off a terminal)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="say what would be deleted; delete nothing"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print what was (or would be) deleted as JSON"),
) -> None:
    """Delete one step (--step N) or all of them (--all); a step's manifest goes first. Asks first on a terminal."""
    from orchestrator.errors import ConfigError

    if (step is None) == (not all_steps):
        raise ConfigError("give exactly one of --step N or --all")
    store = _store(uri, endpoint_url)
    infos = {i.step: i for i in store.steps()}
    if step is not None and step not in infos:
        raise ConfigError(f"no step {step} under {uri}/; `hetspot checkpoints list {uri}` shows the steps")
    steps = sorted(infos, reverse=True) if all_steps else [step]
    what = (f"{len(steps)} step(s) under {uri}/ ({', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}; "
            f"{sum(infos[s].num_objects for s in steps)} object(s), {sum(infos[s].nbytes for s in steps) / 2**20:.2f} MiB)")
    if dry_run or not steps:
        if as_json:
            sys.stdout.write(json.dumps({"deleted": [], "would_delete": steps}) + "\n")
        else:
            typer.echo(f"would delete {what}" if steps else f"no steps under {uri}/: nothing to delete")
        return
    if not yes:
        if not sys.stdin.isatty():
            raise ConfigError(f"checkpoints rm would delete {what}; pass --yes to delete without a terminal "
                              "(or --dry-run to see what would go)")
        if not typer.confirm(f"delete {what}?", default=False):
            typer.echo("nothing deleted")
            return
    n = sum(store.delete_step(s) for s in steps)
    if as_json:
        sys.stdout.write(json.dumps({"deleted": steps, "objects": n}) + "\n")
    else:
        typer.echo(f"deleted {len(steps)} step(s), {n} object(s)")


def export(
    uri: str = typer.Argument(..., help=URI_HELP + " (a finished job's: its last step is its output)"),
    out: str = typer.Option(..., "--out", help="directory to write (new or empty)"),
    fmt: str = typer.Option("hf", "--format", help="hf: a Hugging Face transformers directory"),
    step: int | None = typer.Option(None, "--step", help="the step to export (default: the newest complete one)"),
    max_shard_gib: float = typer.Option(5.0, "--max-shard-gib", min=0.001, help="shard the weights above this size"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print what was written as JSON"),
) -> None:
    """Write a step's weights as config.json + model.safetensors that transformers' LlamaForCausalLM or
    GPT2LMHeadModel loads (every object read is checked against its SHA256 first)."""
    from pathlib import Path

    from orchestrator.errors import ConfigError
    from planner.specs import ModelSpec

    if fmt != "hf":
        raise ConfigError(f"--format {fmt!r} is not known; the one format is 'hf' (Hugging Face transformers)")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty directory; choose a new path (nothing was written)")
    from orchestrator.state.s3_store import CheckpointError

    store = _store(uri, endpoint_url)
    complete = store.complete_steps()
    if not complete or (step is not None and step not in complete):
        raise ConfigError(f"no complete step {'' if step is None else step} under {uri}/; "
                          f"`hetspot checkpoints list {uri}` shows its steps")
    step = max(complete) if step is None else step
    try:
        manifest = store.whole_manifest(step)
    except CheckpointError as e:
        raise ConfigError(f"{e}; it cannot be exported (`hetspot checkpoints verify {uri} --step {step}` says more; "
                          "export a whole step with --step)") from None
    model_meta = manifest.get("meta", {}).get("model")
    if not model_meta:
        raise ConfigError(f"step {step} under {uri} does not record its model (written by an older hetspot); "
                          "it cannot be exported")
    from workers import hf_format

    model = ModelSpec(**model_meta)
    try:
        state, _, nbytes = store.load(step)
    except CheckpointError as e:
        raise ConfigError(f"step {step} cannot be exported: {e}") from None
    files = hf_format.write(target, model, {n: u["param"] for n, u in state.items()}, int(max_shard_gib * 2**30))
    result = {"step": step, "format": "hf", "arch": model.arch, "out": str(target), "files": [f.name for f in files],
              "read_bytes": nbytes}
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        typer.echo(f"exported step {step} of {uri} ({model.arch}, {model.num_params / 1e6:.1f}M parameters) to "
                   f"{target}: {', '.join(result['files'])}")
