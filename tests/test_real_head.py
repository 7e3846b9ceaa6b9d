"""A real `ray start --head` cluster with fake GPUs of two types, driven only through the `hetspot` CLI.

Head: 2 fake A100-80GB; a second `ray start` node: 2 fake T4 (spot). Each run
uses its own HOME (so no ~/.ray/auth_token leaks in) and RAY_AUTH_MODE, and
puts this interpreter's bin directory first on PATH, as an activated virtual
env would, so the Ray Jobs entry point finds hetspot. The walk through every
command runs with token authentication on; the other heads run with it off.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.net import free_port
from tests.own_ray import new_mark, new_temp_dir, stop_marked

# Each head has ports of its own and stops only its own processes (tests/own_ray.py): these run beside the embedded
# test clusters, in the other xdist worker (tests/conftest.py). The rendered AWS config's own commands run `ray stop`
# and take the default ports: that test owns the machine's Ray (`exclusive`).
pytestmark = [pytest.mark.ray, pytest.mark.own_head]

BIN = Path(sys.executable).parent
HETSPOT = str(BIN / "hetspot")
RAY = str(BIN / "ray")
JOB = """
name: head-test
model: {preset: tiny}
train: {global_batch: 8, lr: 0.003, precision: fp32}
runtime: {log_every: 1, dtype: float64}
steps: 4
"""


class RealHead:
    def __init__(self, tmp: Path, auth: bool, bin_dir: Path = BIN):
        self.ray = str(bin_dir / "ray")  # the nodes' interpreter: the one this `ray` runs on
        self.home = tmp / "home"
        (self.home / ".ray").mkdir(parents=True)
        self.token = secrets.token_hex(32) if auth else None
        if auth:
            (self.home / ".ray" / "auth_token").write_text(self.token)
        self.gcs, self.dash, self.metrics = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.dash}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
        self.env |= {"HOME": str(self.home), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
                     "RAY_AUTH_MODE": "token" if auth else "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        self.mark = new_mark()
        self.env |= self.mark
        self.tmp = tmp

    def start(self, head_gpu: str | None = "A100-80GB",
              nodes: tuple[tuple[str, str], ...] = (("t4-spot", "T4"),)) -> None:
        """The head (2 fake GPUs of `head_gpu`, or none), then one 2-GPU spot node per (name, GPU type)."""
        ray_tmp = self.ray_tmp = new_temp_dir()
        gpus = [f'--resources={{"accelerator_type:{head_gpu}": 1}}', "--num-gpus=2",
                f"--labels=hetspot/gpu-type={head_gpu},hetspot/node=head-a100"] if head_gpu else ["--num-gpus=0"]
        self._ray("start", "--head", f"--port={self.gcs}", "--dashboard-host=127.0.0.1",
                  f"--dashboard-port={self.dash}", f"--ray-client-server-port={free_port()}",
                  f"--dashboard-agent-listen-port={free_port()}",
                  "--num-cpus=2", *gpus, f"--temp-dir={ray_tmp}",
                  f"--metrics-export-port={self.metrics}", '--system-config={"metrics_report_interval_ms": 500}')
        for name, gpu in nodes:  # all nodes share this host: each dashboard agent needs a port of its own
            self._ray("start", f"--address=127.0.0.1:{self.gcs}", "--num-cpus=2", "--num-gpus=2",
                      f"--dashboard-agent-listen-port={free_port()}", f'--resources={{"accelerator_type:{gpu}": 1}}',
                      f"--labels=hetspot/gpu-type={gpu},hetspot/node={name},hetspot/market=spot")

    def stop(self) -> None:
        import shutil

        stop_marked(self.mark)
        if getattr(self, "ray_tmp", None):
            shutil.rmtree(self.ray_tmp, ignore_errors=True)

    @property
    def headers(self) -> dict[str, str] | None:
        """What a Ray Jobs client in this process sends: the head's token, when it has one."""
        return {"Authorization": f"Bearer {self.token}"} if self.token else None

    def ray_out(self, *args: str) -> str:
        r = subprocess.run([self.ray, *args], env=self.env, capture_output=True, text=True, timeout=120, cwd=self.tmp)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def _ray(self, *args: str) -> None:
        # From a directory outside the checkout, as on a real head: job entry points run in Ray's
        # working directory, and `python -c` there must not find hetspot's sources by accident.
        r = subprocess.run([self.ray, *args, "--disable-usage-stats"], env=self.env, capture_output=True, text=True,
                           timeout=180, cwd=self.tmp)
        assert r.returncode == 0, r.stdout + r.stderr


def cli(head: RealHead, *args: str, home: Path | None = None, extra_env: dict | None = None, timeout: float = 120):
    """Run `hetspot ...` as a user on another machine would: no RAY_AUTH_MODE, their own HOME."""
    env = {k: v for k, v in head.env.items() if k != "RAY_AUTH_MODE"} | {"HOME": str(home or head.home)}
    env |= extra_env or {}
    r = subprocess.run([HETSPOT, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def assert_inventory(r: subprocess.CompletedProcess) -> None:
    """`hetspot inventory --json` on the default head: both fake GPU types, with counts and markets."""
    assert r.returncode == 0, r.stderr
    inv = json.loads(r.stdout)
    assert inv["gpus_by_type"] == {"A100-80GB": 2, "T4": 2}
    assert {n["name"]: n["market"] for n in inv["nodes"]} == {"head-a100": "on-demand", "t4-spot": "spot"}


def wait_status(head: RealHead, job_id: str, want: tuple[str, ...], *auth: str, timeout: float = 600, **kw) -> dict:
    """Wait until the job is in one of `want` (or ended), then read it with `hetspot status --json` as the user
    would. `timeout` is there to catch a job that hangs, not a slow one: a 4-step job ends in about 20 s on a quiet
    2-core machine and was still running after 240 s there beside two CPU busy loops. The wait asks Ray's job
    client in this process, with the head's token (a `hetspot status` a second would start a Python process a
    second, about 0.7 s of CPU each, beside the other worker's clusters)."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    jobs, deadline = JobSubmissionClient(head.url, headers=head.headers), time.monotonic() + timeout
    while (ray_status := JobStatus(jobs.get_job_status(job_id))).value not in want and not ray_status.is_terminal():
        assert time.monotonic() < deadline, f"job {job_id} is {ray_status.value} after {timeout:.0f} s, not {want}"
        time.sleep(0.5)
    r = cli(head, "status", job_id, "--address", head.url, "--json", *auth, **kw)
    st = json.loads(r.stdout)
    # the exit code tells the truth: 0 succeeded or not ended, the driver's own code for a failed job, 3 stopped
    assert r.returncode == st["exit_code"] == {"SUCCEEDED": 0, "RUNNING": 0, "PENDING": 0, "STOPPED": 3}.get(
        st["status"], st["exit_code"] or 99), (r.returncode, st)
    assert st["status"] == ray_status.value and st["status"] in want, (st, ray_status, want)
    return st


def wait_progress(head: RealHead, job_id: str, ready, timeout: float = 120, token_file: str | None = None) -> None:
    """Wait, in this process (hetspot's own RayJobs, which `hetspot status` prints), until the running job's
    progress satisfies `ready`; the job ending first fails the test."""
    from orchestrator.runtime.ray_jobs import RayJobs

    jobs, deadline = RayJobs(head.url, token_file), time.monotonic() + timeout
    while not ((st := jobs.status(job_id))["progress"] is not None and ready(st["progress"])):
        assert st["status"] in ("PENDING", "RUNNING"), st
        assert time.monotonic() < deadline, f"job {job_id} has no such progress after {timeout:.0f} s: {st}"
        time.sleep(0.5)


class Scraper:
    """Reads a node's metrics port every half second, as Prometheus would, from a job's submission on, keeping the
    newest value of each series tagged with the job. The agent drops a finished worker's series some seconds after
    its last export, so a read after the job's end may find nothing; the job's last values are read while it runs
    (the controller keeps itself up for one export at its end: controller_actor.publish_last_rows)."""

    def __init__(self, port: int, job_id: str, names: tuple[str, ...]):
        import threading

        self.port, self.job_id, self.names, self.last = port, job_id, names, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                name = line.split("{", 1)[0]
                if name in self.names and f'job="{self.job_id}"' in line:
                    self.last[name] = float(line.rsplit(" ", 1)[1])
            self.done.wait(0.5)

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join(timeout=10)
        return self.last


@pytest.fixture
def head(tmp_path):
    h = RealHead(tmp_path, auth=True)
    try:
        h.start()
        yield h
    finally:
        h.stop()


def test_cli_against_a_real_head(head, tmp_path):
    """Every command a user runs against a running cluster, on a head with token authentication on (Ray 2.60's
    `RAY_AUTH_MODE=token`): the token reaches the dashboard, the job's driver and its workers. The same commands
    against heads with authentication off run in the tests below (`submit`, `status`, `logs`, `list` and
    `inventory` in the fails-fast and drain tests), so one head covers what two did."""
    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB)
    user_home = tmp_path / "user"  # the user's machine: no token file unless they pass one
    user_home.mkdir()
    token_file = tmp_path / "token"
    token_file.write_text(head.token)
    # Without a token, and with a wrong one: a clear message, exit 2, no traceback.
    r = cli(head, "inventory", "--address", head.url, "--json", home=user_home)
    assert r.returncode == 2 and "requires an authentication token" in r.stderr and "--token-file" in r.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token")
    r = cli(head, "list", "--address", head.url, "--token-file", str(wrong), home=user_home)
    assert r.returncode == 2 and "rejected the token" in r.stderr
    auth = ["--token-file", str(token_file)]
    outputs = []

    # inventory: both fake GPU types, with counts and markets
    r = cli(head, "inventory", "--address", head.url, "--json", *auth, home=user_home)
    assert_inventory(r)
    outputs.append(r.stdout)

    # submit through Ray Jobs: a job id comes back at once, training runs on the cluster
    r = cli(head, "submit", str(job_file), "--address", head.url, "--json", *auth, home=user_home)
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["job_id"]
    scraper = Scraper(head.metrics, job_id, ("ray_hetspot_train_loss", "ray_hetspot_step"))
    st = wait_status(head, job_id, ("SUCCEEDED", "FAILED", "STOPPED"), *auth, home=user_home)
    # RAY_AUTH_TOKEN works like --token-file
    st = wait_status(head, job_id, ("SUCCEEDED",), home=user_home, extra_env={"RAY_AUTH_TOKEN": head.token})
    logs = cli(head, "logs", job_id, "--address", head.url, *auth, home=user_home).stdout
    assert st["status"] == "SUCCEEDED", logs[-3000:]
    p = st["progress"]
    assert p["step"] == 3 and p["steps"] == 4 and 0 < p["loss"] < 20 and p["tokens_per_s"] > 0
    # structured worker lines name node, rank and stage; progress lines carry every step
    assert "node=head-a100 rank=0 pipeline=0 stage=0" in logs
    # two Ray nodes share this host, so Ray forwards each worker line twice; `logs` shows one copy
    assert sum("hetspot.worker" in ln and "joined world" in ln and " rank=0 pipeline=" in ln
               for ln in logs.splitlines()) == 1
    assert "hetspot-phase" in logs and st["phase"] == "done"  # phases reach the log and `status`
    assert sum("hetspot-progress" in line for line in logs.splitlines()) == 4
    assert "profiling T4: skipped: no CUDA device" in logs  # the profiling pass ran and saw fake GPUs
    outputs += [json.dumps(st), logs]

    r = cli(head, "list", "--address", head.url, "--json", *auth, home=user_home)
    assert [j["job_id"] for j in json.loads(r.stdout)] == [job_id]
    outputs.append(r.stdout)

    # a job that fails on the cluster (its data is not there): `submit --follow`, `logs --follow` and `status` exit
    # with its driver's code (2: refused as bad input), not 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(JOB + "data: {kind: tokens, path: /nowhere/corpus.bin}\n")
    r = cli(head, "submit", str(bad), "--address", head.url, "--follow", *auth, home=user_home, timeout=300)
    assert r.returncode == 2 and "data.path '/nowhere/corpus.bin' does not exist" in r.stdout, (r.returncode,
                                                                                                r.stdout[-2000:])
    bad_id = next(j["job_id"] for j in json.loads(cli(head, "list", "--address", head.url, "--json", *auth,
                                                      home=user_home).stdout) if j["job_id"] != job_id)
    assert cli(head, "logs", bad_id, "--address", head.url, "--follow", *auth, home=user_home).returncode == 2
    assert wait_status(head, bad_id, ("FAILED",), *auth, home=user_home)["exit_code"] == 2

    # unknown job id: exit 2 and the fix
    r = cli(head, "status", "no-such-job", "--address", head.url, *auth, home=user_home)
    assert r.returncode == 2 and "no job 'no-such-job'" in r.stderr and "hetspot list" in r.stderr

    # metrics: Ray's metrics agent exported the controller's gauges for Prometheus, the last step's among them
    last = scraper.stop()
    assert last.get("ray_hetspot_train_loss") == pytest.approx(p["loss"], rel=1e-6), last
    assert last.get("ray_hetspot_step") == 3, last

    long_logs_keep_status_small(head, str(token_file))

    # two jobs, and the queue: a long job trains on the A100s (the planner leaves the T4s idle for the tiny model); a
    # second long job plans on the T4s it finds free, naming the first as holder of the rest; a third finds nothing
    # free and waits in the cluster's queue, shown as queued with who holds the GPUs, then trains once the first is
    # stopped and its workers and placement groups are gone
    long_ids = []
    for _ in range(2):
        r = cli(head, "submit", str(job_file), "--address", head.url, "--steps", "100000", "--json", *auth,
                home=user_home)
        assert r.returncode == 0, r.stderr
        long_ids.append(json.loads(r.stdout)["job_id"])
        wait_progress(head, long_ids[-1], lambda p: True, token_file=str(token_file))
    long_id, beside_id = long_ids
    r = cli(head, "status", beside_id, "--address", head.url, "--json", *auth, home=user_home)
    st = json.loads(r.stdout)
    assert st["status"] == "RUNNING" and st["progress"] is not None
    held = [e for e in st["events"] if e["kind"] == "held"]
    assert held and held[0]["held"] == {"head-a100": {long_id: 2}}, st["events"]
    outputs.append(r.stdout)
    r = cli(head, "submit", str(job_file), "--address", head.url, "--json", *auth, home=user_home)
    queued_id, t_submit = json.loads(r.stdout)["job_id"], time.monotonic()
    phase = wait_phase(head, queued_id, lambda ph: ph.startswith("queued"), str(token_file))
    took_queued = time.monotonic() - t_submit
    assert phase.startswith("queued (1 in line): waiting for a free GPU; held by") and long_id in phase and \
        beside_id in phase, phase
    listed = {j["job_id"]: j for j in json.loads(cli(head, "list", "--address", head.url, "--json", *auth,
                                                     home=user_home).stdout)}
    assert listed[queued_id]["status"] == "QUEUED" and listed[queued_id]["gpus"] == 0, listed
    assert all(listed[j]["status"] == "RUNNING" and listed[j]["gpus"] == 2 for j in long_ids), listed
    r = cli(head, "stop", long_id, "--address", head.url, *auth, home=user_home)
    assert r.returncode == 0 and "stop requested" in r.stdout
    st = wait_status(head, long_id, ("STOPPED", "FAILED", "SUCCEEDED"), *auth, timeout=180,  # STOP_GRACE_S + load
                    home=user_home)
    assert st["status"] == "STOPPED"
    outputs += [r.stdout, json.dumps(st)]
    t_stopped = time.monotonic()
    wait_phase(head, queued_id, lambda ph: not ph.startswith("queued"), str(token_file))
    took_start = time.monotonic() - t_stopped
    st = wait_status(head, queued_id, ("SUCCEEDED", "FAILED"), *auth, home=user_home)
    queued_logs = cli(head, "logs", queued_id, "--address", head.url, *auth, home=user_home).stdout
    assert st["status"] == "SUCCEEDED" and st["progress"]["step"] == 3, queued_logs[-3000:]
    assert [e["kind"] for e in st["events"] if e["kind"] in ("queued", "dequeued")] == ["queued", "dequeued"]
    assert "could not place" not in queued_logs and "GetTimeoutError" not in queued_logs  # no placement wait
    print(f"queued {took_queued:.1f} s after its submission; left the queue {took_start:.1f} s after the "
          "holder stopped")
    outputs += priorities(head, job_file, tmp_path, user_home, token_file, beside_id)
    if wait_status(head, beside_id, ("RUNNING", "STOPPED"), *auth, home=user_home)["status"] == "RUNNING":
        r = cli(head, "stop", beside_id, "--address", head.url, *auth, home=user_home)
        st = wait_status(head, beside_id, ("STOPPED", "FAILED", "SUCCEEDED"), *auth, timeout=180, home=user_home)
        assert st["status"] == "STOPPED"
        outputs += [r.stdout, json.dumps(st)]
    for out in outputs:  # the token never shows in --json output, status or logs
        assert head.token not in out
    pgs = subprocess.run([RAY, "list", "placement-groups", "--address", f"127.0.0.1:{head.gcs}", "--format", "json"],
                         env=head.env, capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + 30
    while '"CREATED"' in pgs.stdout and time.monotonic() < deadline:
        time.sleep(1.0)
        pgs = subprocess.run([RAY, "list", "placement-groups", "--address", f"127.0.0.1:{head.gcs}", "--format",
                              "json"], env=head.env, capture_output=True, text=True, timeout=60)
    assert pgs.returncode == 0 and '"CREATED"' not in pgs.stdout, pgs.stdout


def priorities(head: RealHead, job_file: Path, tmp_path: Path, user_home: Path, token_file: Path,
               beside_id: str) -> list[str]:
    """With the second long job running (`beside_id`): another long job of priority 0 takes the GPUs left free; a
    short job of priority 5 finds nothing free, waits first in line and asks a job of priority 0 holding the most
    GPUs on one node for that node. What that job would keep trains no plan (each runs on one node), so it is
    suspended (its committed step kept), gives its GPUs back and waits in the queue; the short job trains and
    ends; the suspended job resumes from its step. Both jobs' losses match their one-device runs, every step
    once. Every long job is stopped but `beside_id` when it was not the one asked. The status texts, for the
    token check."""
    from orchestrator.job_spec import load_job
    from orchestrator.runtime.progress_lines import PROGRESS
    from tests.oracle import one_device_run

    auth = ["--token-file", str(token_file)]
    r = cli(head, "submit", str(job_file), "--address", head.url, "--steps", "100000", "--json", *auth,
            home=user_home)
    low_id = json.loads(r.stdout)["job_id"]
    wait_progress(head, low_id, lambda p: p["step"] >= 1, token_file=str(token_file))
    urgent = tmp_path / "urgent.yaml"
    urgent.write_text(JOB.replace("runtime: {log_every: 1,", "runtime: {log_every: 1, priority: 5,"))
    r = cli(head, "submit", str(urgent), "--address", head.url, "--json", *auth, home=user_home)
    assert r.returncode == 0, r.stderr
    high_id = json.loads(r.stdout)["job_id"]
    listed = {row["job_id"]: row for row in json.loads(cli(head, "list", "--address", head.url, "--json", *auth,
                                                           home=user_home).stdout)}
    assert listed[high_id]["priority"] == 5 and listed[low_id]["priority"] == 0, listed
    assert listed[high_id]["share"] == listed[low_id]["share"] == "first-come", listed  # runtime.fleet_share
    high = wait_status(head, high_id, ("SUCCEEDED", "FAILED"), *auth, home=user_home)
    assert high["status"] == "SUCCEEDED", high
    kinds = [e["kind"] for e in high["events"]]
    assert kinds.index("queued") < kinds.index("asked") < kinds.index("dequeued"), kinds
    # the lowest-priority job with the most GPUs on one node: either long job (the one on the T4s may have grown
    # onto the A100s when the queued job ended, and the new one then planned on the T4s)
    ((asked_id, nodes),) = next(e for e in high["events"] if e["kind"] == "asked")["asked"].items()
    assert asked_id in (low_id, beside_id) and len(nodes) == 1, high["events"]
    from orchestrator.runtime.ray_jobs import RayJobs

    jobs, deadline = RayJobs(head.url, str(token_file)), time.monotonic() + 120
    while not any(e["kind"] == "dequeued" for e in jobs.status(asked_id)["events"]):  # resumed
        if time.monotonic() > deadline:
            st = jobs.status(asked_id)
            raise AssertionError(f"{asked_id} did not resume: {st['status']} {st['phase']} {st['events']}")
        time.sleep(0.5)
    st = jobs.status(asked_id)
    (s,) = [e for e in st["events"] if e["kind"] == "suspend"]
    assert s["by"] == high_id and s["nodes"] == nodes and s["kept"].startswith("the peer tier"), s
    wait_progress(head, asked_id, lambda p: p["step"] >= s["step"] + 3, token_file=str(token_file))
    assert cli(head, "stop", asked_id, "--address", head.url, *auth, home=user_home).returncode == 0
    low = wait_status(head, asked_id, ("STOPPED", "FAILED", "SUCCEEDED"), *auth, timeout=180, home=user_home)
    restored = [e for e in low["events"] if e["kind"] == "restore"]
    assert restored and restored[-1]["step"] == s["step"], low["events"]  # resumed from the step it kept
    if asked_id != low_id:
        assert cli(head, "stop", low_id, "--address", head.url, *auth, home=user_home).returncode == 0
        assert wait_status(head, low_id, ("STOPPED", "FAILED", "SUCCEEDED"), *auth, timeout=180,
                           home=user_home)["status"] == "STOPPED"
    out = [json.dumps(high), json.dumps(low)]
    for job_id, spec in ((high_id, urgent), (asked_id, job_file)):
        logs = cli(head, "logs", job_id, "--address", head.url, *auth, home=user_home).stdout
        rows = [json.JSONDecoder().raw_decode(line.split(PROGRESS, 1)[1])[0]  # (a line may run on: Ray's log
                for line in logs.splitlines() if PROGRESS in line]  # monitor joins lines written at once)
        losses = {row["step"]: row["loss"] for row in rows}
        assert [row["step"] for row in rows] == list(range(len(rows))) and len(rows) >= 4, (job_id, rows[-3:])
        ref, _ = one_device_run(load_job(spec), len(losses))
        for step, want in enumerate(ref):
            assert abs(losses[step] - want) <= 1e-6 * abs(want), (job_id, step, losses[step], want)
        out.append(logs)
    print(f"priorities: {asked_id} suspended at step {s['step']} for {high_id}, resumed and stopped at step "
          f"{len(rows) - 1}")
    return out


def wait_phase(head: RealHead, job_id: str, ready, token_file: str, timeout: float = 120) -> str:
    """The running job's phase, read as `hetspot status` reads it, once `ready(phase)`; its end first fails."""
    from orchestrator.runtime.ray_jobs import RayJobs

    jobs, deadline = RayJobs(head.url, token_file), time.monotonic() + timeout
    while not ready((st := jobs.status(job_id))["phase"] or ""):
        assert st["status"] in ("PENDING", "RUNNING"), st
        assert time.monotonic() < deadline, f"job {job_id}: no such phase after {timeout:.0f} s: {st}"
        time.sleep(0.5)
    return st["phase"]


def long_logs_keep_status_small(head: RealHead, token_file: str | None = None) -> None:
    """Acceptance 2: `status` reads a bounded tail of a job's log (the State API's log tail), so a job
    of 2,000 committed steps costs what one of 20 does. Two jobs print the driver's lines for 20 and 2,000
    steps (a progress line and three worker lines per step, the events line every 50 steps)."""
    from ray.job_submission import JobSubmissionClient

    from orchestrator.runtime.ray_jobs import TAIL_LINES, RayJobs

    script = ("import json\nfor s in range({n}):\n"
              "    print('hetspot-progress ' + json.dumps({{'step': s, 'steps': {n}, 'loss': 1.0, 'tokens_per_s': 1.0, "
              "'mfu': None, 'step_time_s': 0.1, 'restarts': 1}}))\n"
              "    [print(f'hetspot.worker node=n rank={{r}} step {{s}}: 128 samples') for r in range(3)]\n"
              "    if s % 50 == 0: print('hetspot-events ' + json.dumps([{{'kind': 're-plan', 'cause': 'x', "
              "'at_step': 0, 't_s': 1.0}}]))\n")
    client = JobSubmissionClient(head.url, headers=head.headers)
    ids = {}
    for n in (20, 2000):
        path = Path(head.env["HOME"]) / f"fake_driver_{n}.py"
        path.write_text(script.format(n=n))
        ids[n] = client.submit_job(entrypoint=f"python {path}")
    jobs, took = RayJobs(head.url, token_file), {}
    for n, job_id in ids.items():
        deadline = time.monotonic() + 120
        while client.get_job_status(job_id).value not in ("SUCCEEDED", "FAILED"):
            assert time.monotonic() < deadline, f"the fake driver of {n} steps did not end"
            time.sleep(0.5)
        t0 = time.perf_counter()
        st = jobs.status(job_id)
        took[n] = time.perf_counter() - t0
        assert st["progress"]["step"] == n - 1 and st["events"][0]["kind"] == "re-plan", st
    tail, whole = jobs.tail(ids[2000]), jobs.logs(ids[2000])
    assert len(whole.splitlines()) > TAIL_LINES >= len(tail.splitlines()) > 0  # the whole log is never read
    print(f"status of a 20-step job {took[20]:.3f} s, of a 2,000-step job {took[2000]:.3f} s; log "
          f"{len(whole):,} bytes, tail read {len(tail):,} bytes")


def test_submit_fails_fast_when_the_heads_python_lacks_hetspot(tmp_path):
    """`python` on the head is another interpreter (no hetspot): submit says so with exit 2 at once,
    instead of a job that fails later with "No module named 'orchestrator'"."""
    h = RealHead(tmp_path, auth=False)
    h.env["PATH"] = ":".join(p for p in h.env["PATH"].split(":") if p and Path(p) != BIN)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB)
    try:
        h.start()
        # inventory without authentication: both fake GPU types, with counts and markets
        assert_inventory(cli(h, "inventory", "--address", h.url, "--json"))
        r = cli(h, "submit", str(job_file), "--address", h.url)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "`python` on the cluster's head cannot import hetspot" in r.stderr
        assert "python -m orchestrator.driver" in r.stderr and "Fix:" in r.stderr
        listed = cli(h, "list", "--address", h.url, "--json")  # "at once": refused before any job was submitted
        assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stdout
    finally:
        h.stop()


def bare_python(tmp: Path) -> Path:
    """A `bin/` whose `python` and `ray` import hetspot's dependencies from this environment (a plain path
    entry to its site-packages) but not hetspot itself (its editable install is a .pth hook there, which a
    plain path entry does not run): a cluster where nobody installed hetspot."""
    import site
    import sysconfig

    venv = tmp / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    ours = sysconfig.get_paths()["purelib"]
    (Path(next((venv / "lib").glob("python*/site-packages"))) / "deps.pth").write_text(ours + "\n")
    ray = venv / "bin" / "ray"
    ray.write_text(f"#!{venv / 'bin' / 'python'}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    ray.chmod(0o755)
    check = "import ray, torch, boto3\ntry:\n    import orchestrator\nexcept ImportError:\n    print('no hetspot')"
    r = subprocess.run([str(venv / "bin" / "python"), "-c", check], capture_output=True, text=True, timeout=120,
                       cwd=tmp)
    assert r.stdout.strip() == "no hetspot", (r.stdout, r.stderr[-2000:], site.getsitepackages())
    return venv / "bin"


@pytest.mark.slow  # the rendered-AWS test below runs the same (bare nodes, hetspot shipped) in the default run
def test_a_cluster_without_hetspot_runs_the_job_hetspot_ships(tmp_path):
    """Every node's `python` has Ray, torch and the dependencies but no hetspot; `hetspot submit
    --address` ships planner/, workers/ and orchestrator/ with the job (runtime_env py_modules): the driver,
    the controller, the keepers and the TrainWorkers on both nodes import them, and the job trains."""
    h = RealHead(tmp_path, auth=False, bin_dir=bare_python(tmp_path))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB)
    try:
        h.start()
        r = cli(h, "submit", str(job_file), "--address", h.url, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        job_id = json.loads(r.stdout)["job_id"]
        st = wait_status(h, job_id, ("SUCCEEDED", "FAILED", "STOPPED"))
        logs = cli(h, "logs", job_id, "--address", h.url).stdout
        assert st["status"] == "SUCCEEDED", logs[-3000:]
        assert st["progress"]["step"] == 3 and "hetspot: done: 4 steps" in logs
    finally:
        h.stop()


def test_ray_drain_on_a_real_cluster_moves_the_job_before_the_deadline(tmp_path):
    """On a real `ray start` cluster shaped like deploy/aws (a head without GPUs, spot GPU nodes),
    `ray drain-node` with a deadline on the node the plan uses is a notice: the job drains at a step
    boundary, re-plans onto the other node and loses no step; `hetspot status --json` and the job's
    log carry the drain's timeline. (Ray then terminates the drained node once it is idle.)"""
    h = RealHead(tmp_path, auth=False)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(JOB)
    try:
        h.start(head_gpu=None, nodes=(("a100-spot", "A100-80GB"), ("t4-spot", "T4")))
        # long enough for the switch: the next plan's two new workers start (on the T4 node the plan left idle)
        # while the A100 trains on, and the switch waits for them
        r = cli(h, "submit", str(job_file), "--address", h.url, "--steps", "400", "--json")
        assert r.returncode == 0, r.stderr
        job_id = json.loads(r.stdout)["job_id"]
        wait_progress(h, job_id, lambda p: p.get("step", -1) >= 2)
        st = json.loads(cli(h, "status", job_id, "--address", h.url, "--json").stdout)
        assert st["status"] == "RUNNING" and st["progress"]["step"] >= 2, st
        # who holds what, as another user of the cluster sees it: the job's workers hold their GPUs through
        # placement groups named by the job, which `list` and `inventory` read over the dashboard's State API
        listed = {j["job_id"]: j["gpus"] for j in json.loads(cli(h, "list", "--address", h.url, "--json").stdout)}
        inv = json.loads(cli(h, "inventory", "--address", h.url, "--json").stdout)
        held = [by for n in inv["nodes"] for by in [n["held"]] if by]
        assert listed[job_id] >= 1 and all(set(by) == {job_id} for by in held), (listed, inv["nodes"])
        assert sum(by[job_id] for by in held) == listed[job_id], (listed, inv["nodes"])
        nodes = json.loads(h.ray_out("list", "nodes", "--address", f"127.0.0.1:{h.gcs}", "--format", "json"))
        doomed = next(n["node_id"] for n in nodes if n["labels"].get("hetspot/node") == "a100-spot")
        h.ray_out("drain-node", "--address", f"127.0.0.1:{h.gcs}", "--node-id", doomed, "--reason",
                  "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot", "--deadline-remaining-seconds", "60")
        st = wait_status(h, job_id, ("SUCCEEDED", "FAILED", "STOPPED"), timeout=300)
        logs = cli(h, "logs", job_id, "--address", h.url).stdout
        assert st["status"] == "SUCCEEDED", logs[-3000:]
        drain = next(e for e in st["events"] if e["kind"] == "drain")
        assert "a100-spot" in drain["cause"] and "ray-drain" in drain["cause"] and drain.get("met_deadline") is True, \
            json.dumps(st["events"])
        assert drain["notice_s"] <= drain["snapshot_s"] <= drain["plan_s"] <= drain["first_step_s"] \
            <= drain["deadline_s"]
        assert not any(e["kind"] == "re-plan" for e in st["events"])  # drained, not recovered: no step lost
        assert st["progress"]["step"] == 399 and drain["new_workers"] == 2 and drain["switch_s"] < drain["deadline_s"]
        assert '"phase": "draining a100-spot"' in logs and '"kind": "drain"' in logs  # phase and events lines
    finally:
        h.stop()


# Ray's fake multi-node provider, loaded as an external module: Ray's autoscaler v2 reads a `fake_multinode`
# provider's defaults from an example.yaml that the pip wheel lacks, and an external provider's from Ray's own.
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"


@pytest.mark.exclusive  # the rendered commands run `ray stop` and take Ray's default ports: alone (pyproject)
def test_a_rendered_aws_config_comes_up_on_the_fake_provider_and_runs_the_job_hetspot_ships(tmp_path):
    """Acceptance 5: `hetspot deploy render --cloud aws` with its provider swapped for Ray's fake
    multi-node provider (node types, resources, labels and limits kept) comes up as `ray up` brings up a head:
    the config is the head's ~/ray_bootstrap_config.yaml, the auth token is the file it mounts, and the
    rendered `head_start_ray_commands` run through bash with the autoscaler-v2 environment `ray up` adds. Nothing
    is installed at launch, and the nodes' Python has no hetspot. `hetspot submit
    --address` ships hetspot; the job's fleet asks the autoscaler for a t4-spot node, which comes up with the
    rendered resources and labels, and the job trains with the 1-device run's losses."""
    import yaml
    from ray.autoscaler._private.fake_multi_node.node_provider import (
        FAKE_HEAD_NODE_ID,
        FAKE_HEAD_NODE_TYPE,
    )

    from orchestrator.job_spec import load_job
    from tests.oracle import one_device_losses

    bin_dir = bare_python(tmp_path)
    rendered = tmp_path / "aws.yaml"
    r = subprocess.run([HETSPOT, "deploy", "render", "--cloud", "aws", "--mix", "t4:1,l4:1", "--out", str(rendered)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(rendered.read_text())
    # Nothing is installed at launch: the nodes run the image (here, an interpreter with Ray, torch and
    # hetspot's dependencies but no hetspot: the job ships hetspot itself).
    assert cfg["setup_commands"] == [] and cfg["docker"]["image"]

    head = RealHead(tmp_path, auth=True, bin_dir=bin_dir)  # its HOME holds ~/.ray/auth_token, as mounted
    head.url = "http://127.0.0.1:8265"  # the rendered head's dashboard port
    kept = {"available_node_types": cfg["available_node_types"]}
    from ray.autoscaler._private.util import fillout_defaults

    cfg = fillout_defaults(cfg)  # what `ray up` does with it (Ray's AWS defaults fill what the file leaves out)
    # The fake provider's head instance is always of type `ray.head.default`: the rendered head type, renamed.
    cfg["available_node_types"][FAKE_HEAD_NODE_TYPE] = cfg["available_node_types"].pop(cfg["head_node_type"])
    cfg["head_node_type"] = FAKE_HEAD_NODE_TYPE
    cfg["provider"] = {"type": "external", "module": FAKE_PROVIDER, "use_node_id_as_ip": True,
                       "disable_node_updaters": True, "disable_launch_config_check": True,
                       "launch_multiple": True, "head_node_id": FAKE_HEAD_NODE_ID}
    (head.home / "ray_bootstrap_config.yaml").write_text(yaml.safe_dump(cfg))
    env = head.env | {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                      # what `ray up` puts before the head's start commands (autoscaler v2, Ray's default since
                      # 2.50), with the fake cloud's head instance id
                      "RAY_enable_autoscaler_v2": "1", "RAY_CLOUD_INSTANCE_ID": FAKE_HEAD_NODE_ID,
                      "RAY_NODE_TYPE_NAME": cfg["head_node_type"],
                      "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID}
    env.pop("RAY_AUTH_MODE")  # the rendered command sets it
    job = tmp_path / "fleet.yaml"
    job.write_text(yaml.safe_dump({
        "name": "aws-fake", "steps": 4,
        "model": {"name": "gpt-aws", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "vocab_size": 64,
                  "seq_len": 16},
        "train": {"global_batch": 8, "lr": 0.01, "precision": "fp32"},
        "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 20},
        "fleet": {"types": [{"gpu_type": "T4", "min_nodes": 1, "max_nodes": 1}], "wait_s": 120, "poll_s": 0.5}}))
    try:
        for cmd in cfg["head_start_ray_commands"]:
            r = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
            assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-3000:])
        r = cli(head, "submit", str(job), "--address", head.url, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        job_id = json.loads(r.stdout)["job_id"]
        st = wait_status(head, job_id, ("SUCCEEDED", "FAILED", "STOPPED"), timeout=300)
        logs = cli(head, "logs", job_id, "--address", head.url).stdout
        assert st["status"] == "SUCCEEDED", logs[-3000:]
        assert "Adding 1 node(s) of type t4-spot" in logs, logs[-3000:]
        inv = cli(head, "inventory", "--address", head.url, "--json")  # the node the autoscaler launched
        assert inv.returncode == 0, inv.stderr
        t4 = [n for n in json.loads(inv.stdout)["nodes"] if n["gpu_type"] == "T4"]
        want_gpus = kept["available_node_types"]["t4-spot"]["resources"]["GPU"]
        assert [(n["num_gpus"], n["market"]) for n in t4] == [(want_gpus, "spot")], inv.stdout
        from orchestrator.runtime.progress_lines import progress_rows

        rows = progress_rows(logs)
        want = one_device_losses(load_job(job), 4)
        assert [r["step"] for r in rows] == [0, 1, 2, 3], rows
        assert all(abs(r["loss"] - w) <= 1e-4 * abs(w) for r, w in zip(rows, want, strict=True)), (rows, want)
    finally:
        head.stop()
