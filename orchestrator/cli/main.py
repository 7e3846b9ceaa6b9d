"""`hetspot` command line: parses arguments, calls orchestrator.api, prints tables or JSON.

User errors (HetspotError) print one paragraph to stderr and exit with their
code (2 for configuration), never a traceback.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import typer

from orchestrator.cli.common import console, err_console
from orchestrator.cli.common import print_json as _print_json
from orchestrator.errors import HetspotError

# rich_markup_mode=None: help as click prints it, a description column of at least 46 characters at 80 columns
# (rich's option panels squeeze it to a dozen where an option has a long --no- form); the same in every sub-app.
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Elastic training on mixed spot GPUs.",
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
    objective: str = typer.Option(None, help="throughput, or cost ($ per million tokens); with --fleet auto the "
                                  "default is cost"),
    fleet: str = typer.Option(None, "--fleet", help="auto: choose the fleet to request from --catalog (which "
                              "instance types, how many) together with its plan; the job's cluster: is not used"),
    catalog: str = typer.Option(None, "--catalog", help="YAML catalog of instance types with prices and "
                                "preemption rates (examples/catalog-aws.yaml); with --fleet auto"),
    budget: str = typer.Option(None, "--budget", help="$/h the fleet may cost; with --fleet auto (with "
                               "--objective throughput: the most tokens/s within it, after preemptions)"),
    min_tokens_per_s: str = typer.Option(None, "--min-tokens-per-s", help="with --fleet auto and the cost "
                                         "objective: the cheapest fleet per token that delivers at least this many "
                                         "tokens/s after its expected preemptions"),
    deadline_h: str = typer.Option(None, "--deadline-h", help="with --fleet auto and the cost objective: the job's "
                                   "steps done within this many hours (a floor on tokens/s, after preemptions)"),
    workers: str = typer.Option(None, "--workers", help="with --fleet auto: processes that plan candidate fleets at "
                                "once (default: the CPUs this process may use, at most 8); the choice is the same"),
) -> None:
    """Plan asymmetric DP/PP/TP for the job's cluster and compare with baselines; or, with --fleet auto,
    choose the fleet to ask for as well."""
    from orchestrator import api
    from orchestrator.errors import ConfigError

    if objective not in (None, "throughput", "cost"):
        raise ConfigError(f"--objective {objective!r} must be 'throughput' or 'cost'")
    if fleet is not None and fleet != "auto":
        raise ConfigError(f"--fleet {fleet!r}: the one value is auto (choose the fleet from --catalog)")
    budget, min_tokens_per_s, deadline_h = (_number(flag, v) for flag, v in (
        ("--budget", budget), ("--min-tokens-per-s", min_tokens_per_s), ("--deadline-h", deadline_h)))
    if fleet is None and any(v is not None for v in (catalog, budget, min_tokens_per_s, deadline_h)):
        raise ConfigError("--catalog, --budget, --min-tokens-per-s and --deadline-h choose a fleet: add --fleet auto")
    procs = _workers(workers)
    from orchestrator.job_spec import load_job

    job = load_job(job_file)
    auto = job.fleet.auto if job.fleet is not None and job.cluster is None else None
    if fleet == "auto" or (fleet is None and auto is not None):  # --fleet auto, or the job file's fleet: {auto:}
        if fleet == "auto" and catalog is None:
            raise ConfigError("--fleet auto needs --catalog FILE: the instance types to choose from, with prices and "
                              "preemption rates (see examples/catalog-aws.yaml)")
        with console.status("choosing a fleet") as status:
            result = api.plan_fleet(job, job_file, catalog if fleet == "auto" else auto.catalog,
                                    objective or (auto.objective if fleet is None else "cost"),
                                    budget if fleet == "auto" else auto.budget_per_hour,
                                    lambda n: status.update(f"choosing a fleet: {n} fleets planned"),
                                    min_tokens_per_s, deadline_h, procs)
    else:
        if workers is not None:
            raise ConfigError("--workers plans candidate fleets at once: it needs --fleet auto (or a job file with "
                              "fleet: {auto: ...} and no cluster:)")
        result = api.plan_job(job, job_file, objective or "throughput")
    if as_json:
        _print_json(result)
    else:
        from orchestrator.cli.tables import fleet_table, plan_tables

        if "fleet" in result:
            fleet_table(result["fleet"], console)
        plan_tables(result, console)


def _workers(value: str | None) -> int:
    """--workers: a whole number of processes, 1 or more; by default the CPUs this process may use, at most 8."""
    from orchestrator.errors import ConfigError

    if value is None:
        import os

        return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--workers {value!r} must be a whole number of processes, 1 or more; e.g. --workers 2")
    return n


def _number(flag: str, value: str | None) -> float | None:
    """A numeric flag read here, so a bad value is one line naming it (typer's own check prints a usage box)."""
    if value is None:
        return None
    from orchestrator.errors import ConfigError

    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a number; give e.g. {flag} 10") from None


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
    plan_file: str | None = typer.Option(None, "--plan",
                                         help="a plan JSON (from `hetspot plan --json`); local runs only"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="optimizer steps (default: the job's steps)"),
    resume: bool = typer.Option(False, "--resume", help="go on from the newest complete step under checkpoint.uri"),
    restore_from: str | None = typer.Option(None, "--restore-from", help="nearest (survivors, peer memory, then S3; "
                                            "the default) or s3 (S3 only, for comparison)"),
    replan_on_loss: bool = typer.Option(False, "--replan-on-loss",
                                        help="with --plan: after a node loss, re-plan on the survivors instead "
                                        "of failing"),
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
        if job.fleet is not None and job.fleet.auto is not None:  # fails early (exit 2) when nothing fits
            err_console.print(f"fleet to ask for: {api.choose_job_fleet(job, job_file)}", highlight=False)
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
            sys.stdout.flush()
            raise typer.Exit(jobs.ended(job_id))  # a failed or stopped job is not a success (job_exit_code)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    total = steps or (api.check_data(job, job_file).steps if job.train.epochs else job.steps)  # epochs: from the corpus
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
        last = result["first_step"] + len(result["losses"]) - 1
        console.print(f"trained steps {result['first_step']}-{last} in {result['wall_s']:.1f} s "
                      f"(start-up {result['startup_s']:.1f} s): loss {result['losses'][0]:.4f} -> "
                      f"{result['losses'][-1]:.4f}, {result['tokens_per_s']:,.0f} tokens/s over the step times, "
                      f"{result['restarts']} re-plans")
        if result["val_losses"]:
            (s0, v0), (s1, v1) = min(result["val_losses"].items()), max(result["val_losses"].items())
            held = job.train.eval_batches * job.train.global_batch
            console.print(f"validation loss {v0:.4f} after step {s0} -> {v1:.4f} after step {s1} "
                          f"({len(result['val_losses'])} evaluations of {held} held-out samples)")
        console.print(f"run record: {result['run_record']}  (hetspot status {result['run_record']} --history; "
                      f"hetspot plot {result['run_record']} -o loss.png)", highlight=False, soft_wrap=True)


ENDPOINT_HELP = "S3 endpoint of a run record in S3 (MinIO, moto); default AWS_ENDPOINT_URL, else AWS"


@app.command()
@_user_errors
def status(
    job: str = typer.Argument(..., help="the id `hetspot submit --address` printed, or a run record: "
                              "s3://BUCKET/PREFIX/runs/ID or a local hetspot-runs/ID folder (no cluster needed)"),
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    history: bool = typer.Option(False, "--history", help="every committed step's loss, tokens/s and step time "
                                 "(from the job's run record)"),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
    as_json: bool = typer.Option(False, "--json", help="print the status as JSON"),
) -> None:
    """A job's state, its last committed step (loss, tokens/s, MFU), checkpoints, ETA and events.

    With a job id it asks the cluster; a job with an S3 checkpoint is read from its run record there (a few
    kilobytes, whatever the job's length), else from the job's log. With a run record's location it reads that,
    after the cluster is gone too."""
    from orchestrator.cli.tables import print_status
    from orchestrator.runtime.run_record import is_location, read_record, read_steps

    if is_location(job):
        rec = read_record(job, endpoint_url)
        st = {"job_id": rec["job_id"], "status": rec["state"], "message": rec.get("error") or "",
              "phase": rec.get("phase"), "progress": rec["progress"], "events": rec["events"],
              "summary": rec["summary"], "run_record": job}
        location = job
    else:
        st = _jobs(address, token_file).status(job, endpoint_url)
        location = st.get("run_record")
    if history:
        if "summary" not in st:
            from orchestrator.errors import ConfigError

            raise ConfigError(f"--history: job {job} has no run record this machine can read (a job with a "
                              "checkpoint.uri keeps one in S3; pass its location: hetspot status s3://.../runs/ID)")
        st["history"] = read_steps(location, {"summary": st["summary"]}, endpoint_url)
    if as_json:
        _print_json(st)
    else:
        print_status(job, st, console)
    # 0: succeeded or not ended; a failed job's driver code (1, or 2 for bad input); 3: stopped (ray_jobs.py)
    code = st.get("exit_code", 1 if st.get("status") == "failed" else 0)
    if code:
        raise typer.Exit(code)


@app.command()
@_user_errors
def plot(
    run: str = typer.Argument(..., help="a run record (s3://BUCKET/PREFIX/runs/ID or a local hetspot-runs/ID folder), "
                              "or a job id with --address whose run record is in S3"),
    out: Path = typer.Option(..., "-o", "--out", help="the PNG to write"),
    address: str | None = _address_option(True),
    token_file: str | None = _token_option(),
    endpoint_url: str | None = typer.Option(None, "--endpoint-url", help=ENDPOINT_HELP),
) -> None:
    """Loss and throughput of a job over its steps, with its recoveries marked, from its run record."""
    from orchestrator.drills.report import run_plot
    from orchestrator.errors import ConfigError
    from orchestrator.runtime.run_record import is_location, read_record, read_steps

    if not is_location(run):
        if not address:
            raise ConfigError(f"{run}: not a run record; pass s3://BUCKET/PREFIX/runs/ID or a hetspot-runs/ID "
                              "folder (`hetspot submit` prints where its run record is), or a job id with --address")
        where = _jobs(address, token_file).status(run, endpoint_url).get("run_record")
        if not where:
            raise ConfigError(f"{run}: this job has no run record this machine can read (a job with a "
                              "checkpoint.uri keeps one in S3); pass its location instead")
        run = where
    rec = read_record(run, endpoint_url)
    rows = read_steps(run, rec, endpoint_url)
    if not rows:
        raise ConfigError(f"{run}: the run record holds no committed step yet; nothing to plot")
    run_plot(rec, rows, out)
    console.print(f"wrote {out}")


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
        raise typer.Exit(jobs.ended(job_id))  # 0 succeeded, the driver's code if it failed, 3 stopped
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
    """hetspot jobs on a running cluster, oldest first, with their priority (runtime.priority), how they share the
    cluster (runtime.fleet_share: first-come or weighted) and the GPUs each holds; a running job's phase, and
    QUEUED for one that waits in the cluster's queue for GPUs others hold (its place in line in the phase)."""
    from collections import Counter
    from concurrent.futures import ThreadPoolExecutor

    from rich.table import Table

    from orchestrator.cluster.holders import held_by_job

    jobs = _jobs(address, token_file)
    rows = jobs.list()
    held: Counter[str] = Counter()
    for by_job in held_by_job(jobs.placement_groups()).values():
        held.update(by_job)
    def phase(job_id: str) -> str | None:  # what its controller does now: its run record's or its log's last phase
        try:
            return jobs.status(job_id).get("phase")
        except Exception as e:  # noqa: BLE001 - one job's status (it ended meanwhile) does not fail the list
            return f"(not read: {type(e).__name__})"

    running = [r["job_id"] for r in rows if r["status"] == "RUNNING"]
    with ThreadPoolExecutor(max_workers=min(8, len(running) or 1)) as pool:  # one request per running job, at once
        phases = dict(zip(running, pool.map(phase, running), strict=True))
    for r in rows:
        r["gpus"] = held.get(r["job_id"], 0)
        r["phase"] = phases.get(r["job_id"])
        if (r["phase"] or "").startswith("queued"):
            r["status"] = "QUEUED"
    if as_json:
        _print_json(rows)
        return
    t = Table(title="hetspot jobs")
    for col in ("job id", "name", "status", "priority", "share", "GPUs held", "phase"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["job_id"], r["name"], r["status"], str(r["priority"]), r["share"], str(r["gpus"]),
                  r["phase"] or "")
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
    endpoint_url: str | None = typer.Option(None, "--endpoint-url",
                                            help="EC2 endpoint (default: AWS_ENDPOINT_URL or AWS)"),
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
    for col in ("node", "GPUs", "held by", "type", "market", "zone", "instance", "$/h"):
        t.add_column(col)
    for n in result["nodes"]:
        held = ", ".join(f"{c} {job}" for job, c in n.get("held", {}).items()) or "-"
        t.add_row(n["name"], str(n["num_gpus"]), held, n["gpu_type"], n["market"], n["zone"] or "-",
                  n["instance_type"] or "-", f"{n['price_per_hour']:.2f}" if n["price_per_hour"] is not None else "-")
    console.print(t)
    console.print("total: " + ", ".join(f"{c}x {g}" for g, c in sorted(result["gpus_by_type"].items())))


def _register_subcommands() -> None:
    from orchestrator.cli.checkpoints import checkpoints_app, export, list_steps, rm, verify
    from orchestrator.cli.data import data_app, prepare
    from orchestrator.cli.deploy import deploy_app, render
    from orchestrator.cli.drill import drill, simulate

    app.command(name="drill")(_user_errors(drill))
    app.command(name="simulate")(_user_errors(simulate))

    deploy_app.command(name="render")(_user_errors(render))
    app.add_typer(deploy_app, name="deploy")
    for name, fn in (("list", list_steps), ("verify", verify), ("rm", rm), ("export", export)):
        checkpoints_app.command(name=name)(_user_errors(fn))
    app.add_typer(checkpoints_app, name="checkpoints")
    data_app.command(name="prepare")(_user_errors(prepare))
    app.add_typer(data_app, name="data")


_register_subcommands()


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning for the user (a deprecated field, a setting ignored) as one line on stderr: what it says names
    the file and the field, never the library line that raised it."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def main() -> None:
    import warnings

    warnings.showwarning = _one_line_warning
    app()


if __name__ == "__main__":
    main()
