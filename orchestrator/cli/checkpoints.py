"""`hetspot checkpoints list|verify|rm|export URI`: a job's S3 steps (registered as a sub-app by
orchestrator/cli/main.py)."""

from __future__ import annotations

import contextlib
import json
import sys

import typer

checkpoints_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                              help="A job's checkpoints in S3: list, verify, delete, export.")
URI_HELP = "the job's checkpoint.uri, s3://BUCKET/PREFIX"
ENDPOINT_HELP = "S3 endpoint (default: AWS_ENDPOINT_URL, else AWS)"


def _store(uri: str, endpoint_url: str | None):
    from orchestrator.errors import ConfigError
    from orchestrator.state.s3_store import check_access
    from workers.s3_data import redact

    if endpoint_url is not None and not endpoint_url.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint-url {redact(endpoint_url)!r} must be an http:// or https:// URL (or leave it "
                          "out: AWS_ENDPOINT_URL, else AWS)")
    try:
        return check_access(uri, endpoint_url)
    except ValueError as e:
        message = str(e).replace("checkpoint.uri", "URI").replace("checkpoint.endpoint_url", "--endpoint-url")
        raise ConfigError(message) from None


@contextlib.contextmanager
def _s3(what: str, uri: str):
    """S3 refusing a call (a list or read denied, throttled past the retries, the endpoint gone) ends the command
    in one line naming what was refused and the likely fix (exit 2), never a traceback."""
    from botocore.exceptions import BotoCoreError, ClientError

    from orchestrator.errors import CheckpointError, ConfigError, Refusal
    from orchestrator.state.s3_store import s3_code

    try:
        yield
    except (BotoCoreError, ClientError, CheckpointError) as e:
        if isinstance(e, CheckpointError) and e.refusal is not Refusal.UNREADABLE:
            raise  # a verdict on a step, not S3 refusing this command
        code = s3_code(e) if not isinstance(e, CheckpointError) else _code_in(str(e))
        raise ConfigError(_refused(what, uri, code)) from None


def _code_in(message: str) -> str:
    """The S3 error code a refusal's message ends with ("... could not be read (AccessDenied)")."""
    return message.rsplit("(", 1)[-1].rstrip(")") if message.endswith(")") else "refused"


def _refused(what: str, uri: str, code: str) -> str:
    fix = {"AccessDenied": "the credentials or the bucket policy do not allow it; check both (s3:ListBucket and "
                           "s3:ListBucketMultipartUploads on the bucket; s3:GetObject, s3:PutObject, s3:DeleteObject "
                           "and s3:AbortMultipartUpload on the prefix)",
           "SlowDown": "S3 throttled the prefix past the retries; try again in a minute",
           }.get(code, "try again; if it persists, check the endpoint and the bucket policy")
    return f"{what} under {uri}/ was refused by S3 ({code}): {fix}"


def list_steps(
    uri: str = typer.Argument(..., help=URI_HELP),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the steps as JSON"),
) -> None:
    """Steps under URI, newest first: good (whole, every piece there), refused and why, or without a manifest
    (ignored); objects and bytes."""
    store = _store(uri, endpoint_url)
    with _s3("listing the steps", uri):
        listing = store._listing()
        statuses = {st.step: st for st in store.survey(listing=listing)}
        infos = store.steps(listing)
    rows = []
    for i in infos:
        st = statuses.get(i.step)
        state = "incomplete" if st is None else "good" if st.ok else str(st.refusal)
        rows.append({"step": i.step, "complete": i.complete, "state": state, "reason": None if st is None or st.ok
                     else st.reason, "objects": i.num_objects, "bytes": i.nbytes,
                     "run_id": st.meta.get("run_id") if st is not None else None})
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
        state = {"good": "good (whole, every piece there)", "incomplete": "incomplete (no manifest: ignored)"}.get(
            r["state"], f"refused: {r['reason']}")
        t.add_row(str(r["step"]), state, str(r["objects"]), f"{r['bytes'] / 2**20:.2f}")
    Console().print(t)


def verify(
    uri: str = typer.Argument(..., help=URI_HELP),
    step: int | None = typer.Option(None, "--step", help="one step (default: every complete step)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
) -> None:
    """Check each complete step: its manifest covers the whole model, every piece is in the bucket, and every
    object re-read matches its SHA256 and its region. Each step's result is printed as it is found; exit 1 if
    one fails."""
    from orchestrator.errors import ConfigError

    store = _store(uri, endpoint_url)
    with _s3("listing the steps", uri):
        complete = store.complete_steps()
    if step is not None and step not in complete:
        raise ConfigError(f"no complete step {step} under {uri}/; `hetspot checkpoints list {uri}` shows its steps")
    steps = [step] if step is not None else complete
    if not steps and not as_json:
        typer.echo(f"no complete steps under {uri}/: nothing to verify")
        return
    result = {}
    for s in steps:
        with _s3(f"checking step {s}", uri):
            result[s] = store.verify(s)
        if not as_json:
            typer.echo(f"step {s}: " + ("ok" if not result[s] else "BAD: " + "; ".join(result[s])))
    if as_json:
        rows = [{"step": s, "ok": not p, "problems": p} for s, p in result.items()]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
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
    """Delete one step (--step N) or all of them (--all): a step's manifest goes first, then its objects and its
    interrupted multipart uploads. Asks first on a terminal. Exit 1 naming every key S3 did not delete."""
    from orchestrator.errors import ConfigError

    if (step is None) == (not all_steps):
        raise ConfigError("give exactly one of --step N or --all")
    store = _store(uri, endpoint_url)
    with _s3("listing the steps", uri):
        infos = {i.step: i for i in store.steps()}
    if step is not None and step not in infos:
        raise ConfigError(f"no step {step} under {uri}/; `hetspot checkpoints list {uri}` shows the steps")
    steps = sorted(infos, reverse=True) if all_steps else [step]
    what = (f"{len(steps)} step(s) under {uri}/ ({', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''}; "
            f"{sum(infos[s].num_objects for s in steps)} object(s), "
            f"{sum(infos[s].nbytes for s in steps) / 2**20:.2f} MiB)")
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
    with _s3("deleting the steps", uri):
        results = [store.delete_step(s) for s in steps]
    done = [r.step for r in results if r.ok]
    left = [(r.step, k, code) for r in results for k, code in r.left]
    n = sum(r.num_deleted for r in results)
    if as_json:
        sys.stdout.write(json.dumps({"deleted": done, "objects": n, "left": [
            {"step": s, "key": k, "error": c} for s, k, c in left]}) + "\n")
    elif done:
        typer.echo(f"deleted {len(done)} step(s), {n} object(s)")
    if left:
        failed = sorted({s for s, _, _ in left})
        typer.echo(f"error: S3 did not delete {len(left)} object(s) of step(s) {', '.join(map(str, failed))}: "
                   + ", ".join(f"{k} ({c})" for _, k, c in left[:5]) + (", ..." if len(left) > 5 else "")
                   + "; they are still there (check the bucket policy's s3:DeleteObject), run rm again", err=True)
        raise typer.Exit(1)


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
    from orchestrator.state.s3_store import CheckpointError, Refusal

    store = _store(uri, endpoint_url)
    with _s3("listing the steps", uri):
        complete = store.complete_steps()
        good, refused = store.usable() if step is None else ([], [])
    if step is not None and step not in complete:
        raise ConfigError(f"no complete step {step} under {uri}/; `hetspot checkpoints list {uri}` shows its steps")
    if step is None and not good:
        denied = [r for r in refused if r.refusal is Refusal.UNREADABLE]
        if denied:
            raise ConfigError(_refused(f"reading step {denied[0].step}", uri, _code_in(denied[0].reason)))
        why = f" ({'; '.join(r.reason for r in refused[:3])})" if refused else ""
        raise ConfigError(f"no good step under {uri}/{why}; `hetspot checkpoints list {uri}` shows its steps")
    candidates = [step] if step is not None else [m["step"] for m in good]
    for r in refused:
        typer.echo(f"step {r.step} refused: {r.reason}", err=True)
    for chosen in candidates:
        try:
            with _s3(f"reading step {chosen}", uri):
                manifest = store.whole_manifest(chosen)
                model_meta = manifest.get("meta", {}).get("model")
                if not model_meta:
                    raise ConfigError(f"step {chosen} under {uri} does not record its model (written by an older "
                                      "hetspot); it cannot be exported")
                state, _, nbytes = store.load(chosen)
        except CheckpointError as e:
            if step is not None:
                raise ConfigError(f"step {chosen} cannot be exported: {e} (`hetspot checkpoints verify {uri} --step "
                                  f"{chosen}` says more; export a whole step with --step)") from None
            typer.echo(f"step {chosen} refused: {e}; trying the previous good step", err=True)
            continue
        step = chosen
        break
    else:
        raise ConfigError(f"no step under {uri}/ could be read whole; `hetspot checkpoints verify {uri}` says why")
    from workers import hf_format

    model = ModelSpec(**model_meta)
    files = hf_format.write(target, model, {n: u["param"] for n, u in state.items()}, int(max_shard_gib * 2**30))
    result = {"step": step, "format": "hf", "arch": model.arch, "out": str(target), "files": [f.name for f in files],
              "read_bytes": nbytes}
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        typer.echo(f"exported step {step} of {uri} ({model.arch}, {model.num_params / 1e6:.1f}M parameters) to "
                   f"{target}: {', '.join(result['files'])}")
