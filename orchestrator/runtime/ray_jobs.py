"""Talking to a running Ray cluster over its dashboard's HTTP API: Ray Jobs and the State API.

`hetspot submit --address http://HEAD:8265` hands the job to Ray Jobs
(`JobSubmissionClient`), as a Ray user expects: the entry point is
`python -m orchestrator.driver` on the cluster, with the validated job spec in
its environment, and hetspot's own packages (planner, workers, orchestrator)
travel with the job in its runtime env (`py_modules`), so every process of the
job, on every node, imports the submitter's hetspot: a cluster needs only Ray,
torch and hetspot's declared dependencies, never an install of hetspot.
`status`, `logs`, `stop` and `list` are the same client's calls.

Token authentication (Ray 2.60): a head started with `RAY_AUTH_MODE=token`,
or where `~/.ray/auth_token` exists, answers 401 without a token and 403 for
a wrong one. The token comes from, in order: `--token-file`, `RAY_AUTH_TOKEN`,
`RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`. It is sent as a Bearer header and
never printed, logged, put into job metadata or the runtime env.
"""

from __future__ import annotations

import builtins
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from orchestrator.errors import ConfigError
from orchestrator.job_spec import JobSpec
from orchestrator.runtime.progress_lines import (
    ENV_ID,
    ENV_JOB,
    ENV_RESUME,
    ENV_STEPS,
    last_events,
    last_phase,
    last_progress,
)

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
STOPPED_EXIT = 3  # `hetspot status`, `logs --follow` and `submit --follow` for a stopped job (`job_exit_code`)


def job_exit_code(status: str, driver_exit_code: int | None = None) -> int:
    """What the CLI exits with for a job in `status` (Ray's job state): 0 for one that succeeded or has not ended
    (pending, running); for a failed one its driver's own exit code (1: the job failed; 2: refused as bad input,
    its data or bucket), or 1 where Ray kept none (a driver killed); `STOPPED_EXIT` for a stopped one."""
    if status == "FAILED":
        return driver_exit_code if isinstance(driver_exit_code, int) and driver_exit_code > 0 else 1
    return STOPPED_EXIT if status == "STOPPED" else 0
PROBE_ENTRYPOINT = 'python -c "import ray, torch, boto3, pydantic, orchestrator.driver, planner, workers.actor"'
DEPENDENCIES = "ray[default]==2.60.*, torch, boto3, pydantic, typer, pyyaml, rich, numpy, safetensors"


def shipped_runtime_env(env_vars: dict[str, str] | None = None) -> dict:
    """The job's runtime env: hetspot's packages as py_modules (directories Ray zips and uploads once per
    content hash), and the job's environment variables."""
    import orchestrator
    import planner
    import workers

    mods = [str(Path(str(m.__file__)).resolve().parent) for m in (planner, workers, orchestrator)]
    return {"py_modules": mods, "excludes": ["__pycache__", "*.pyc"]} | ({"env_vars": env_vars} if env_vars else {})
log = logging.getLogger("hetspot.ray_jobs")
T = TypeVar("T")
TAIL_LINES = 3000  # `status` reads this much of a job's log at most (the driver repeats its events line within it)
# `hetspot stop` is Ray's job stop: SIGTERM to the driver, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (Ray's default
# 3 s, read by the job's supervisor from the job's environment). The driver's SIGTERM handler withdraws the fleet's
# demand on the autoscaler; on a busy head it was seen to need more than 3 s, and a driver killed before it withdrew
# leaves the demand standing: the GPU nodes stay up, billed, until someone clears it.
STOP_GRACE_S = 30
FIX_TOKEN = ("pass --token-file PATH, set RAY_AUTH_TOKEN, or put the cluster's token in ~/.ray/auth_token "
             "(on the head: `ray get-auth-token`)")


def resolve_token(token_file: str | None = None) -> tuple[str | None, str]:
    """(token, where it came from). The token itself is never shown."""
    if token_file:
        p = Path(token_file).expanduser()
        if not p.is_file():
            raise ConfigError(f"--token-file {token_file!r} does not exist; pass the file holding the cluster's token")
        return _read_token(p, "--token-file"), "--token-file"
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    for where in (os.environ.get("RAY_AUTH_TOKEN_PATH"), "~/.ray/auth_token"):
        if where and Path(where).expanduser().is_file():
            return _read_token(Path(where).expanduser(), where), where
    return None, "none"


def _read_token(p: Path, where: str) -> str:
    token = p.read_text().strip()
    if not token:
        raise ConfigError(f"the token file from {where} is empty; {FIX_TOKEN}")
    return token


def dashboard_url(address: str) -> str:
    """`http://HOST:8265` from `HOST:PORT` or a URL; checked reachable within seconds."""
    url = address if "://" in address else f"http://{address}"
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ConfigError(f"--address {address!r} must be the Ray dashboard URL, like http://HEAD:8265")
    port = u.port or (443 if u.scheme == "https" else 8265)
    try:
        socket.create_connection((u.hostname, port), timeout=3.0).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray dashboard at {url}: {e.strerror or e}. Check the head is up and "
                          "its dashboard port (default 8265) is reachable.") from None
    return f"{u.scheme}://{u.hostname}:{port}"


class RayJobs:
    """A thin, error-translating wrapper of JobSubmissionClient for one cluster."""

    def __init__(self, address: str, token_file: str | None = None):
        from ray.job_submission import JobSubmissionClient

        self.url = dashboard_url(address)
        token, self.token_source = resolve_token(token_file)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = self._call(lambda: JobSubmissionClient(self.url, headers=self.headers))

    def _call(self, fn: Callable[[], T], job_id: str | None = None) -> T:
        from ray.exceptions import AuthenticationError

        try:
            return fn()
        except AuthenticationError as e:
            if "Authentication required" in str(e):
                raise ConfigError(f"the cluster at {self.url} requires an authentication token and none was "
                                  f"found; {FIX_TOKEN}") from None
            raise ConfigError(f"the cluster at {self.url} rejected the token from {self.token_source}; "
                              f"{FIX_TOKEN}") from None
        except RuntimeError as e:
            text = str(e)
            if job_id is not None and ("404" in text or "does not exist" in text):
                raise ConfigError(f"no job {job_id!r} on the cluster at {self.url}; `hetspot list --address "
                                  f"{self.url}` shows its jobs") from None
            raise ConfigError(f"the Ray dashboard at {self.url} answered: {_redact(text, self.headers)}") from None
        except OSError as e:  # requests' ConnectionError and friends
            raise ConfigError(f"lost the connection to {self.url}: {type(e).__name__}") from None

    # -- jobs -----------------------------------------------------------------
    def check_interpreter(self, timeout_s: float = 90.0) -> None:
        """Fail fast (exit 2) when `python` on the head cannot import hetspot as the job ships it.

        The job's entry point is `python -m orchestrator.driver`, with hetspot's packages shipped beside it; a
        head whose `python` lacks Ray, torch or another dependency would accept the job and fail it later. A
        tiny probe job with the same runtime env finds out first, in a few seconds.
        """
        probe = f"hetspot-probe-{secrets.token_hex(4)}"
        self._call(lambda: self.client.submit_job(entrypoint=PROBE_ENTRYPOINT, submission_id=probe,
                                                  runtime_env=shipped_runtime_env()))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                status = str(getattr(st := self._call(lambda: self.client.get_job_status(probe)), "value", st))
                if status in TERMINAL or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            if status != "SUCCEEDED":
                tail = [ln for ln in self._call(lambda: self.client.get_job_logs(probe)).splitlines() if ln.strip()]
                raise ConfigError(
                    f"`python` on the cluster's head cannot import hetspot ({status}: "
                    f"{tail[-1] if tail else 'no output'}). The job would fail at its entry point "
                    "`python -m orchestrator.driver`. hetspot ships its own packages with each job; the nodes' "
                    f"`python` needs its dependencies ({DEPENDENCIES}). Fix: install those into the interpreter "
                    "that `python` names on every node (or use an image that has them; see docs/deploy.md), or "
                    "start Ray (`ray start`) from that environment.")
        finally:
            try:
                self.client.delete_job(probe)
            except Exception as e:  # a probe left in the job list is harmless; record it
                log.debug("could not delete probe job %s: %s", probe, e)

    def submit(self, job: JobSpec, steps: int | None = None, resume: bool = False) -> str:
        self.check_interpreter()
        job_id = f"hetspot-{_slug(job.name)}-{secrets.token_hex(4)}"
        # Worker lines reach the job log undeduplicated and without colour codes, so they stay parseable.
        env = {ENV_JOB: job.model_dump_json(), ENV_ID: job_id, "RAY_DEDUP_LOGS": "0", "RAY_COLOR_PREFIX": "0",
               "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}
        if steps:
            env[ENV_STEPS] = str(steps)
        if resume:
            env[ENV_RESUME] = "1"
        return self._call(lambda: self.client.submit_job(
            entrypoint="python -m orchestrator.driver", submission_id=job_id,
            runtime_env=shipped_runtime_env(env), metadata=self._metadata(job, job_id, steps)))

    @staticmethod
    def _metadata(job: JobSpec, job_id: str, steps: int | None) -> dict[str, str]:
        """Ray job metadata: the job's name and steps, and where its run record is when another machine can read
        it (S3: `hetspot status` reads it there instead of the job's whole log)."""
        meta = {"hetspot_job": job.name, "hetspot_steps": str(steps or job.steps),
                "hetspot_priority": str(job.runtime.priority), "hetspot_share": job.runtime.fleet_share}
        if job.checkpoint is not None:
            from orchestrator.runtime.run_record import record_location

            meta["hetspot_record"] = record_location(job.checkpoint.uri, job_id)
            meta["hetspot_endpoint"] = job.checkpoint.endpoint_url or ""
        return meta

    def status(self, job_id: str, endpoint_url: str | None = None) -> dict:
        """The job's state from Ray, and its progress and events: from its run record in S3 when it has one
        (a few kilobytes, whatever the job's length), else from the tail of its log (`tail`; the driver
        repeats its events line every `EVENTS_EVERY` steps, so the tail holds the newest)."""
        info = self._call(lambda: self.client.get_job_info(job_id), job_id)
        out: dict[str, Any] = {
            "job_id": job_id, "status": str(info.status.value if hasattr(info.status, "value") else info.status),
               "message": info.message, "start_time": info.start_time, "end_time": info.end_time,
               "metadata": info.metadata or {}}
        out["exit_code"] = job_exit_code(out["status"], getattr(info, "driver_exit_code", None))
        where = out["metadata"].get("hetspot_record")
        if where:
            from orchestrator.errors import ConfigError
            from orchestrator.runtime.run_record import read_record

            try:
                rec = read_record(where, endpoint_url or out["metadata"].get("hetspot_endpoint") or None)
            except ConfigError as e:  # not written yet, or not readable from here: the log still says it
                log.info("run record not read (%s); reading the job's log", e)
            else:
                return out | {"progress": rec["progress"], "phase": rec.get("phase"), "events": rec["events"],
                              "summary": rec["summary"], "run_record": where}
        tail = self.tail(job_id, getattr(info, "driver_node_id", None))
        logs = tail if tail is not None else self.logs(job_id)
        out["progress"] = last_progress(logs)
        phase = last_phase(logs)
        out["phase"] = phase["phase"] if phase else None
        out["events"] = last_events(logs)
        return out

    def tail(self, job_id: str, node_id: str | None = None, lines: int = TAIL_LINES) -> str | None:
        """The last `lines` lines of the job's driver log, through the dashboard's State API (what `ray logs
        --submission-id ID --tail N` reads; it needs the driver's node, `node_id`, else asked of Ray Jobs): the
        same size on a job of 20 steps or of 20,000. None when the dashboard does not serve it (the caller reads
        the whole log instead)."""
        import requests

        if node_id is None:
            node_id = getattr(self._call(lambda: self.client.get_job_info(job_id), job_id), "driver_node_id", None)
        if not node_id:
            return None
        try:
            params: dict[str, str | int] = {"submission_id": job_id, "node_id": node_id, "lines": lines, "timeout": 30}
            r = requests.get(f"{self.url}/api/v0/logs/file", headers=self.headers, timeout=30, params=params)
        except OSError as e:
            log.info("no log tail from %s (%s); reading the whole log", self.url, type(e).__name__)
            return None
        if r.status_code != 200:
            log.info("no log tail from %s (HTTP %d); reading the whole log", self.url, r.status_code)
            return None
        return r.text

    def logs(self, job_id: str) -> str:
        return self._call(lambda: self.client.get_job_logs(job_id), job_id)

    def follow(self, job_id: str) -> Iterator[str]:
        """Yield log chunks as the driver writes them, until the job ends."""
        import asyncio

        self.status(job_id)  # a clear error for an unknown id before streaming
        agen: Any = self.client.tail_job_logs(job_id)  # an async generator (aclose), typed as an iterator
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(agen.aclose())
            loop.close()

    def ended(self, job_id: str, timeout_s: float = 30.0) -> int:
        """The exit code (`job_exit_code`) of a job whose log stream has ended: Ray may mark it ended a moment
        after its last line, so its state is asked again until it is terminal (at most `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self._call(lambda: self.client.get_job_info(job_id), job_id)
            status = str(getattr(info.status, "value", info.status))
            if status in TERMINAL or time.monotonic() > deadline:
                return job_exit_code(status, getattr(info, "driver_exit_code", None))
            time.sleep(0.5)

    def stop(self, job_id: str) -> bool:
        self.status(job_id)
        return bool(self._call(lambda: self.client.stop_job(job_id), job_id))

    def list(self) -> list[dict]:
        rows = []
        for info in self._call(self.client.list_jobs):
            meta = info.metadata or {}
            if not meta.get("hetspot_job"):
                continue
            rows.append({"job_id": info.submission_id, "name": meta["hetspot_job"],
                         "status": str(getattr(info.status, "value", info.status)), "start_time": info.start_time,
                         "end_time": info.end_time, "priority": int(meta.get("hetspot_priority") or 0),
                         "share": meta.get("hetspot_share") or "first-come"})
        return sorted(rows, key=lambda r: r["start_time"] or 0)

    # -- nodes ----------------------------------------------------------------
    def nodes(self) -> builtins.list[dict]:  # (`list` here is RayJobs.list)
        """Alive nodes in `ray.nodes()` form, from the State API (for discovery over HTTP)."""
        from ray.util.state.common import StateResource

        out = []
        for n in self._state_rows(StateResource.NODES):
            out.append({"NodeID": n["node_id"], "Alive": n["state"] == "ALIVE", "NodeName": n.get("node_name") or
                        n.get("node_ip"), "NodeManagerAddress": n.get("node_ip", ""),
                        "Resources": n.get("resources_total") or {}, "Labels": n.get("labels") or {}})
        return out

    def placement_groups(self) -> dict[str, dict]:
        """The cluster's placement groups in `ray.util.placement_group_table()` form, from the State API: which job
        holds which GPUs (orchestrator/cluster/holders.py)."""
        from ray.util.state.common import StateResource

        from orchestrator.cluster.holders import table_from_state_api

        return table_from_state_api(self._state_rows(StateResource.PLACEMENT_GROUPS))

    def _state_rows(self, resource: Any) -> builtins.list[dict]:
        """Every row of one State API resource, with its detail columns."""
        from ray.util.state.api import StateApiClient
        from ray.util.state.common import ListApiOptions

        headers = self.headers | {"Content-Type": "application/json"}
        client = self._call(lambda: StateApiClient(self.url, headers=headers))
        rows = self._call(lambda: client.list(resource, ListApiOptions(detail=True, limit=10_000),
                                              raise_on_missing_output=False))
        return [r if isinstance(r, dict) else r.__dict__ for r in rows]


def _slug(name: str) -> str:
    s = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return s[:32] or "job"


def _redact(text: str, headers: dict) -> str:
    """The server's error without its secrets, and without a server-side traceback: only its last line."""
    if "Traceback (most recent call last)" in text:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() not in ("", ".")]
        text = f"{text.split('Traceback', 1)[0].strip()} {lines[-1]}".strip()
    for v in headers.values():
        text = text.replace(v, "<redacted>").replace(v.removeprefix("Bearer "), "<redacted>")
    return text
