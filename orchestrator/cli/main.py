"""`hetspot` command line: parses arguments, calls orchestrator.api, prints tables or JSON.

User errors (HetspotError) print one paragraph to stderr and exit with their
code (2 for configuration), never a traceback.
"""

from __future__ import annotations

import functools
import os
import sys

import typer

from orchestrator.cli.common import console, err_console
from orchestrator.cli.common import print_json as _print_json
from orchestrator.errors import HetspotError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Elastic training on mixed spot GPUs.",
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("hetspot")
        except PackageNotFoundError:  # run from a checkout that was never installed
            v = "unknown (not installed)"
        console.print(f"hetspot {v}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                            help="print hetspot's version and exit")) -> None:
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
        from orchestrator.cli.tables import plan_tables

        plan_tables(result, console)


ADDRESS_ENV = ["HETSPOT_ADDRESS", "RAY_API_SERVER_ADDRESS"]
TOKEN_HELP = "file with the cluster's auth token (default: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)"


def _address_option(required: bool):
    """--address, read from HETSPOT_ADDRESS (or Ray's RAY_API_SERVER_ADDRESS) when not given; where a command
    needs one, `_need_address` says so (exit 2) instead of the parser marking the flag required."""
    help_ = "Ray dashboard of a running cluster, http://HEAD:8265" + ("" if required else "; none: run locally")
    return typer.Option(None, "--address", envvar=ADDRESS_ENV, help=help_, show_envvar=True)


def _need_address(address: str | None) -> str:
    if not address:
        from orchestrator.errors import ConfigError

        raise ConfigError("--address is needed: the Ray dashboard of a running cluster, http://HEAD:8265 (or set "
                          "HETSPOT_ADDRESS)")
    return address


def _jobs(address: str | None, token_file: str | None):
    """The Ray Jobs client of a command that needs a running cluster (exit 2 without an address)."""
    from orchestrator.runtime.ray_jobs import RayJobs

    return RayJobs(_need_address(address), token_file)


def _env_address() -> str | None:
    return next((os.environ[k] for k in ADDRESS_ENV if os.environ.get(k)), None)


def _token_option():
    return typer.Option(None, "--token-file", help=TOKEN_HELP)


@app.command()
@_user_errors
def submit(
    job_file: str = typer.Argument(..., help="job YAML"),
    address: str | None = _address_option(False),
    token_file: str | None = _token_option(),
    plan_file: str | None = typer.Option(None, "--plan", help="a plan JSON (from `hetspot plan --json`); local runs only"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="optimizer steps (default: the job's steps)"),
    resume: bool = typer.Option(False, "--resume", help="go on from the newest complete step under checkpoint.uri"),
    restore_from: str | None = typer.Option(None, "--restore-from", help="nearest (survivors, peer memory, then S3; "
                                            "the default) or s3 (S3 only, for comparison)"),
    replan_on_loss: bool = typer.Option(False, "--replan-on-loss",
                                        help="with --plan: after a node loss, re-plan on the survivors instead of failing"),
    follow: bool = typer.Option(False, "--follow", help="with --address: stream the job's logs until it ends"),
    as_json: bool = typer.Option(False, "--json", help="print the result (local) or the job id (--address) as JSON"),
) -> None:
    """Train a job: on a running Ray cluster through Ray Jobs (--address), or on the embedded test cluster."""
    from orchestrator import api
    from orchestrator.job_spec import load_job

    job = api.with_restore_from(load_job(job_file), restore_from, job_file)  # validate before anything starts
    if address:
        from orchestrator.errors import ConfigError

        if plan_file:
            raise ConfigError("--plan works for local runs only; on a cluster the job plans on the GPUs it finds")
        if replan_on_loss:
            raise ConfigError("--replan-on-loss goes with --plan, for local runs only; on a cluster the job always "
                              "re-plans on the GPUs it finds")
        jobs = _jobs(address, token_file)
        job_id = jobs.submit(job, steps, resume)
        if as_json:
            _print_json({"job_id": job_id, "address": jobs.url})
        else:
            console.print(f"submitted [bold]{job_id}[/] to {jobs.url}\n"
                          f"  hetspot status {job_id} --address {jobs.url}\n"
                          f"  hetspot logs {job_id} --address {jobs.url} --follow")
        if follow:
            from orchestrator.runtime.progress_lines import dedupe_worker_lines

            seen: set[str] = set()
            for chunk in jobs.follow(job_id):
                sys.stdout.write(dedupe_worker_lines(chunk, seen))
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = steps or job.steps
    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                        TimeElapsedColumn(), console=err_console, disable=as_json)
    with progress:
        task = progress.add_task("train", total=total, info="starting")

        def on_status(msg: str) -> None:
            progress.update(task, info=msg)

        def on_step(s: int, loss: float, tok_s: float) -> None:
            progress.update(task, completed=s + 1, info=f"step {s} loss {loss:.4f} {tok_s:,.0f} tok/s")

        result = api.submit_local(job_file, plan_file, steps, on_step=on_step, on_status=on_status,
                                  replan_on_loss=replan_on_loss, resume=resume, restore_from=restore_from)
    if as_json:
        _print_json(result)
    else:
        console.print(f"trained steps {result['first_step']}-{result['first_step'] + len(result['losses']) - 1} in {result['wall_s']:.1f} s "
                      f"(start-up {result['startup_s']:.1f} s): loss {result['losses'][0]:.4f} -> "
                      f"{result['losses'][-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s over the step times, "
                      f"{result['restarts']} re-plans")


@app.command()
@_user_errors
def status(
    job_id: str = typer.Argument(..., help="the id `hetspot submit --address` printed"),
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON"),
) -> None:
    """A submitted job's state and its last committed step (loss, tokens/s, MFU)."""
    st = _jobs(address, token_file).status(job_id)
    if as_json:
        _print_json(st)
        return
    console.print(f"[bold]{job_id}[/]: {st['status']}" + (f" ({st['message']})" if st["message"] else ""))
    from orchestrator.runtime.metrics import format_mfu

    p = st["progress"]
    if st.get("phase"):
        console.print(f"  phase: {st['phase']}")
    if p:
        console.print(f"  step {p['step'] + 1}/{p['steps']}: loss {p['loss']:.4f}, {p['tokens_per_s']:,.0f} tokens/s, "
                      f"MFU {format_mfu(p['mfu'])}, step {p['step_time_s']:.2f} s, {p['restarts']} re-plans")
        if "upload_lag_steps" in p:
            s3 = "none yet" if p["s3_step"] is None else f"step {p['s3_step']}"
            console.print(f"  S3: newest {s3}, {p['upload_lag_steps']} steps behind, {p['upload_backlog']} "
                          f"upload(s) in flight or waiting, {p['failed_uploads']} failed")
            if p.get("s3_no_access"):
                console.print(f"  S3: no write access from {', '.join(p['s3_no_access'])}: their uploads fail "
                              "(give those nodes credentials that may write the bucket)")
    else:
        console.print("  no step committed yet")
    for e in st.get("events", []):
        times = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in e.items()
                          if k.endswith("_s") and isinstance(v, int | float))
        tiers = ", ".join(f"{t} {n / 2**20:.1f} MiB" for t, n in e.get("bytes_by_tier", {}).items())
        console.print(f"  {e['kind']} at step {e['at_step']}: {e['cause']}" + (f" ({times})" if times else "")
                      + (f"; restored bytes: {tiers}" if tiers else ""))


@app.command()
@_user_errors
def logs(
    job_id: str = typer.Argument(..., help="job id"),
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    follow: bool = typer.Option(False, "--follow", "-f", help="keep streaming until the job ends"),
) -> None:
    """The job driver's output: progress lines, and worker lines naming node, rank and stage."""
    from orchestrator.runtime.progress_lines import dedupe_worker_lines
    jobs = _jobs(address, token_file)
    if follow:
        seen: set[str] = set()
        for chunk in jobs.follow(job_id):
            sys.stdout.write(dedupe_worker_lines(chunk, seen))
            sys.stdout.flush()
    else:
        sys.stdout.write(dedupe_worker_lines(jobs.logs(job_id)))


@app.command()
@_user_errors
def stop(
    job_id: str = typer.Argument(..., help="job id"),
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    as_json: bool = typer.Option(False, "--json", help="print {job_id, stopped} as JSON"),
) -> None:
    """Stop a submitted job (its controller, workers and placement groups go with it)."""
    stopped = _jobs(address, token_file).stop(job_id)
    if as_json:
        _print_json({"job_id": job_id, "stopped": bool(stopped)})
        return
    console.print(f"{job_id}: {'stop requested' if stopped else 'already finished'}")


@app.command(name="list")
@_user_errors
def list_jobs(
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    as_json: bool = typer.Option(False, "--json", help="print the jobs as JSON"),
) -> None:
    """hetspot jobs on a running cluster, oldest first."""
    from rich.table import Table

    rows = _jobs(address, token_file).list()
    if as_json:
        _print_json(rows)
        return
    t = Table(title="hetspot jobs")
    for col in ("job id", "name", "status"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["job_id"], r["name"], r["status"])
    console.print(t)


@app.command()
@_user_errors
def inventory(
    address: str | None = typer.Option(None, "--address", help="a running cluster: dashboard http://HEAD:8265, or "
                                       "GCS HOST:6379 / auto (default: HETSPOT_ADDRESS or RAY_API_SERVER_ADDRESS "
                                       "when --job is not given either)"),
    token_file: str | None = _token_option(),
    job_file: str | None = typer.Option(None, "--job", help="show the embedded test cluster of this job file"),
    ec2_region: str | None = typer.Option(None, "--ec2-region", help="read EC2 facts for nodes with an instance id"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help="EC2 endpoint (default: AWS_ENDPOINT_URL or AWS)"),
    as_json: bool = typer.Option(False, "--json", help="print the discovered ClusterSpec and nodes as JSON"),
) -> None:
    """List the GPUs of a Ray cluster: type, count, market, zone, price."""
    from rich.table import Table

    from orchestrator import api

    if address is None and job_file is None:  # flags win over the environment
        address = _env_address()
    result = api.inventory(address, job_file, ec2_region, endpoint_url, token_file)
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


def _register_subcommands() -> None:
    from orchestrator.cli.checkpoints import checkpoints_app, export, list_steps, rm, verify
    from orchestrator.cli.deploy import deploy_app, render
    from orchestrator.cli.drill import drill, simulate

    app.command(name="drill")(_user_errors(drill))
    app.command(name="simulate")(_user_errors(simulate))

    deploy_app.command(name="render")(_user_errors(render))
    app.add_typer(deploy_app, name="deploy")
    for name, fn in (("list", list_steps), ("verify", verify), ("rm", rm), ("export", export)):
        checkpoints_app.command(name=name)(_user_errors(fn))
    app.add_typer(checkpoints_app, name="checkpoints")


_register_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
