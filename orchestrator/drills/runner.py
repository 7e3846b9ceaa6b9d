"""Run a drill on the embedded Ray test cluster: the reference run, then the same job with the faults injected.

The S3 tier is moto's threaded server on 127.0.0.1 (reached by boto3 over HTTP,
stopped and started again for an outage); spot notices come from one fake
metadata server per node (orchestrator/preemption/metadata_server.py); Ray
drains go through `ray drain-node`. The controller runs in this process and is
stepped here, so step-bound faults land at exact points: before a step, inside
it (the doomed node's ranks stall in it first), while an upload is held, or
while a recovery restores state.

The oracle (`DrillResult.oracle_holds`): every step's loss matches the reference
run's (relative 1e-4), every sample of the job was trained exactly once in the
committed steps (as the loss-reporting ranks list them), and the scenario's
expectations (lost steps, re-plans, bytes per tier, ...) hold.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.drills.scenario import Fault, Scenario, check_expect
from orchestrator.job_spec import CheckpointSpec, JobSpec
from planner import ClusterSpec, NodeSpec

log = logging.getLogger("hetspot.drill")
REL_TOL = 1e-4
BUCKET = "hetspot-drill"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's threaded S3 server; `outage(s)` stops it and starts it again on the same port (state kept)."""

    def __init__(self):
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            from orchestrator.errors import ConfigError

            raise ConfigError("a drill's S3 tier is moto's server: pip install 'hetspot\\[drill]'") from None

        self._cls = ThreadedMotoServer
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, self.port = self.server.get_host_and_port()
        self.url = f"http://{host}:{self.port}"
        self.down_s = 0.0

    def bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.url, region_name="us-east-1").create_bucket(Bucket=name)

    def outage(self, seconds: float) -> threading.Thread:
        self.server.stop()
        t0 = time.monotonic()

        def back() -> None:
            time.sleep(seconds)
            self.server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
            self.server.start()
            self.down_s += time.monotonic() - t0
            log.warning("S3 is back after %.1f s", time.monotonic() - t0)

        t = threading.Thread(target=back, daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self.server.stop()


@dataclass
class DrillResult:
    name: str
    steps: int
    global_batch: int
    tokens_per_step: int
    losses: dict[int, float]
    reference: list[float]
    max_rel_diff: float
    commits: list[tuple[int, float, float]]  # (step, seconds since start, step time) in commit order
    events: list[dict]
    faults: list[dict]  # as injected: kind, nodes, at step / time
    recoveries: list[dict]
    bytes_by_tier: dict[str, int]
    lost_steps: int
    samples: dict
    wall_s: float
    useful_s: float
    uploads: list[dict]
    expect_failures: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def oracle_holds(self) -> bool:
        return (self.error is None and self.max_rel_diff <= REL_TOL and self.samples["exactly_once"]
                and not self.expect_failures and len(self.losses) == len(self.reference))

    def to_json(self) -> dict:
        return {"name": self.name, "oracle_holds": self.oracle_holds, "error": self.error, "steps": self.steps,
                "losses": [self.losses.get(s) for s in range(self.steps)], "reference_losses": self.reference,
                "max_rel_diff": self.max_rel_diff, "faults": self.faults, "recoveries": self.recoveries,
                "events": self.events, "bytes_by_tier": self.bytes_by_tier, "lost_steps": self.lost_steps,
                "samples": self.samples, "goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                "useful_s": round(self.useful_s, 3), "expect_failures": self.expect_failures,
                "failed_uploads": sum(1 for u in self.uploads if u["error"]),
                "tokens_per_s": [{"t_s": round(t, 3), "step": s, "tokens_per_s": round(self.tokens_per_step / dt, 1)}
                                 for s, t, dt in self.commits if dt > 0]}


def drill_job(sc: Scenario, s3_url: str) -> JobSpec:
    """The scenario's job as the drill runs it: its S3 tier on the drill's server, notices polled fast."""
    j = sc.job
    ck = j.checkpoint
    uri = ck.uri if ck is not None else f"s3://{BUCKET}/{sc.name}"
    ck = (ck or CheckpointSpec(uri=uri)).model_copy(update={"endpoint_url": s3_url})
    rt = {"notices": sc.notice_cloud(), "notice_poll_s": min(j.runtime.notice_poll_s, 0.2)}
    if sc.added_nodes() and not j.runtime.scale_check_every:
        rt["scale_check_every"] = 1
    return j.model_copy(update={"checkpoint": ck, "runtime": j.runtime.model_copy(update=rt)})


def check_samples(samples: dict[int, list], steps: int, global_batch: int) -> dict:
    """Every sample index of steps [0, steps) trained exactly once in the committed steps."""
    seen: dict[int, int] = {}
    for ranges in samples.values():
        for a, n in ranges:
            for i in range(a, a + n):
                seen[i] = seen.get(i, 0) + 1
    want = steps * global_batch
    missing = sum(1 for i in range(want) if i not in seen)
    repeated = sum(1 for c in seen.values() if c > 1)
    extra = sum(1 for i in seen if i >= want)
    return {"expected": want, "seen": len(seen), "missing": missing, "repeated": repeated, "outside": extra,
            "exactly_once": missing == repeated == extra == 0}


class Drill:
    """One scenario on a fresh embedded cluster (or `cluster`, an EmbeddedCluster already connected)."""

    def __init__(self, sc: Scenario, cluster=None, s3: S3Server | None = None,
                 on_line: Callable[[str], None] | None = None):
        for k, v in CREDS.items():
            os.environ.setdefault(k, v)  # the nodes' processes read S3 with these, as with an instance role
        self.sc, self.say = sc, on_line or (lambda m: None)
        self.own_s3 = s3 is None
        self.s3 = s3 or S3Server()
        self.job = drill_job(sc, self.s3.url)
        from orchestrator.state.s3_store import parse_uri

        bucket = parse_uri(self.job.checkpoint.uri)[0]
        try:
            self.s3.bucket(bucket)
        except Exception as e:  # an existing bucket (a shared server) is fine
            log.debug("bucket %s: %s", bucket, e)
        self.own_cluster = cluster is None
        self.cluster = cluster
        self.imds: dict[str, object] = {}
        self.timers: list[threading.Timer] = []
        self.fired: list[dict] = []
        self.threads: list[threading.Thread] = []
        self.c = None
        self.t0 = 0.0

    # -- cluster ---------------------------------------------------------------------------
    def _start_nodes(self) -> None:
        from orchestrator.cluster.embedded import EmbeddedCluster
        from orchestrator.preemption.metadata_server import FakeMetadataServer

        noticed = {n for f in self.sc.faults if f.kind == "notice" and f.cloud != "ray" for n in f.nodes}
        for n in noticed:
            self.imds[n] = FakeMetadataServer().start()
        first = [n for n in self.job.cluster.nodes if n.name not in self.sc.added_nodes()]
        if self.cluster is None:
            self.say(f"starting the embedded Ray cluster: {len(first)} nodes")
            self.cluster = EmbeddedCluster(ClusterSpec.model_construct(nodes=[]))
            self.cluster.connect()
        for n in first:
            self._add(n)

    def _add(self, n: NodeSpec) -> None:
        from orchestrator.preemption.ray_notices import LABEL_METADATA_URL

        labels = {LABEL_METADATA_URL: self.imds[n.name].url} if n.name in self.imds else None
        self.cluster.nodes[n.name] = self.cluster.add(n, labels=labels)

    def kill(self, names: list[str]) -> None:
        """Remove nodes at once (threads); wait until Ray reports them dead."""
        import ray

        names = [n for n in names if n in self.cluster.nodes]
        ts = [threading.Thread(target=self.cluster.remove, args=(n,)) for n in names]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        until = time.monotonic() + 30
        while any(x["Alive"] and (x.get("Labels") or {}).get("hetspot/node") in names for x in ray.nodes()):
            if time.monotonic() > until:
                log.warning("Ray still reports %s alive after 30 s", names)
                break
            time.sleep(0.1)

    # -- runs ------------------------------------------------------------------------------
    def reference(self, steps: int) -> tuple[list[float], dict]:
        """The same job without faults (no S3 tier, no notices), on the nodes there at the start."""
        from orchestrator.cluster.node_sources import DeclaredNodes
        from orchestrator.controller import State
        from orchestrator.controller_actor import make_controller

        j = self.job.model_copy(update={"checkpoint": None, "runtime": self.job.runtime.model_copy(
            update={"notices": "none", "scale_check_every": 0})})
        present = ClusterSpec(nodes=[n for n in j.cluster.nodes if n.name in self.cluster.nodes])
        c = make_controller(j, steps, nodes=DeclaredNodes(present))
        self.say(f"reference run: {steps} steps without faults")
        if c.run() != State.DONE:
            raise RuntimeError(f"the reference run failed: {c.error}")
        return [c.progress.losses[s] for s in range(steps)], c.progress.samples

    def run(self, reference: list[float] | None = None, steps: int | None = None, timed: list[Fault] | None = None,
            until_s: float | None = None) -> DrillResult:
        """Reference run, then the drill. `until_s`: end the job at the first commit after this time (traces)."""
        from orchestrator.cluster.node_sources import DeclaredNodes
        from orchestrator.controller import State
        from orchestrator.controller_actor import make_controller
        from planner.specs import tokens_per_step

        steps = steps or self.job.steps
        error, commits, wall = None, [], 0.0
        try:
            self._start_nodes()
            if reference is None and until_s is None:
                reference, _ = self.reference(steps)
            self.nodes = DeclaredNodes(self.job.cluster)
            self.recovery_armed: list[str] | None = None
            self.c = c = make_controller(self.job, steps if until_s is None else 10**9, nodes=self.nodes,
                                         on_phase=self._on_phase)
            self.say(f"drill run: {len(self.sc.faults)} faults")
            by_step = sorted((f for f in self.sc.faults if f.at_step is not None), key=lambda f: f.at_step)
            after_commit: list[tuple[int, Callable[[], None]]] = []
            self.t0 = time.monotonic()
            for f in (timed or []) + [f for f in self.sc.faults if f.at_s is not None]:
                t = threading.Timer(f.at_s, self._fire, (f,))
                t.daemon = True
                t.start()
                self.timers.append(t)
            commits: list[tuple[int, float, float]] = []
            last = -1
            while c.state not in (State.DONE, State.FAILED):
                if c.state == State.TRAINING:
                    while by_step and by_step[0].at_step <= c.progress.committed + 1:
                        after_commit += self._fire(by_step.pop(0)) or []
                c.step()
                if c.progress.committed != last:
                    if c.progress.committed > last:
                        s = c.progress.committed
                        commits.append((s, c.clock.now() - c.started_at, c.progress.step_time_s.get(s, 0.0)))
                        for at, action in [a for a in after_commit if a[0] <= s]:
                            after_commit.remove((at, action))
                            action()
                    last = c.progress.committed
                if until_s is not None and time.monotonic() - self.t0 >= until_s and c.steps > c.progress.committed + 1:
                    c.finish_after(c.progress.committed + 1)
            if c.state == State.FAILED:
                error = c.error
            wall = c.clock.now() - c.started_at
        finally:
            self._stop()
        done = c.progress.committed + 1 if self.c is not None else 0
        if until_s is not None and error is None:
            steps = done
            reference, _ = self.reference(steps)
        if self.own_cluster:
            self.cluster.shutdown()
        return self._result(steps, reference or [], commits, wall, error, tokens_per_step(c.model, c.train.global_batch))

    def _stop(self) -> None:
        for t in self.timers:
            t.cancel()
        for t in self.threads:
            t.join(timeout=120)
        for s in self.imds.values():
            s.stop()
        if self.own_s3:
            self.s3.stop()
        if not self.own_cluster:  # a shared cluster: this scenario's nodes go, the next one adds its own
            self.kill([n.name for n in self.job.cluster.nodes])

    # -- faults ------------------------------------------------------------------------------
    def _now(self) -> float:
        return round(self.c.clock.now() - self.c.started_at, 3) if self.c else 0.0

    def _record(self, f: Fault, **extra) -> None:
        row = {"kind": f.kind, "nodes": list(f.nodes), "at_step": f.at_step, "at_s": f.at_s,
               "injected_s": self._now(), "committed": self.c.progress.committed} | extra
        self.fired.append(row)
        self.say(f"fault: {f.kind} {', '.join(f.nodes)} at {row['injected_s']:.2f} s (after step {row['committed']})")

    def _fire(self, f: Fault) -> list | None:
        """Inject `f` now; returns actions to run after a later commit (for faults in two parts)."""
        import ray

        c = self.c
        if f.kind in ("preempt", "preempt-during-recovery"):
            self._stall(f.nodes, c.progress.committed + 1)
            self._later(0.5, self.kill, f.nodes)
            self._record(f)
            if f.kind == "preempt-during-recovery":
                self.recovery_armed = list(f.then) or []
                self._armed_fault = f
        elif f.kind == "notice":
            self._notice(f)
        elif f.kind == "preempt-during-upload":
            c.store.flush()
            ray.get([k.delay_uploads.remote(3.0) for k in c.store.keepers.values()])
            step = c.progress.committed + 1

            def kill_mid_upload() -> None:
                self.kill(f.nodes)
                for name, k in list(c.store.keepers.items()):
                    if name not in f.nodes:
                        ray.get(k.delay_uploads.remote(0.0))
                self._record(f, upload_step=step)
            return [(step, kill_mid_upload)]
        elif f.kind == "corrupt-s3":
            self._corrupt(f)
        elif f.kind == "s3-outage":
            self.threads.append(self.s3.outage(f.for_s))
            self._record(f, for_s=f.for_s)
        elif f.kind == "add-node":
            for n in self.job.cluster.nodes:
                if n.name in f.nodes:
                    self._add(n)
            self._record(f)
        return None

    def _later(self, seconds: float, fn, *args) -> None:
        t = threading.Timer(seconds, fn, args)
        t.daemon = True
        t.start()
        self.threads.append(t)

    def _stall(self, nodes: list[str], step: int) -> None:
        """The nodes' ranks stall inside `step`, so the kill lands mid-step (their peers wait in a collective)."""
        import ray

        g = self.c.group
        if g is None or not hasattr(g, "run"):
            return
        from workers import layout

        ranks = layout.ranks(g.plan)
        refs = [g.run.workers[i].inject_fault.remote(step, "hang") for i, r in enumerate(ranks) if r.node in nodes]
        if refs:
            ray.get(refs, timeout=30)

    def _on_phase(self, phase: str) -> None:
        if phase == "restoring state" and getattr(self, "recovery_armed", None) is not None and self.c.progress.restarts:
            names = self.recovery_armed or sorted({s.node for p in self.c.plan.pipelines for s in p.stages})[:1]
            self.recovery_armed = None
            self.kill(names)
            self._record(self._armed_fault.model_copy(update={"kind": "preempt (during recovery)", "nodes": names}))

    def _notice(self, f: Fault) -> None:
        deadline = datetime.now(timezone.utc) + timedelta(seconds=f.deadline_s)
        for name in f.nodes:
            if f.cloud == "aws":
                self.imds[name].aws_spot(deadline)
            elif f.cloud == "gcp":
                self.imds[name].gcp_preempt()  # GCP's own notice gives about 30 s; the node goes at deadline_s
            elif f.cloud == "azure":
                self.imds[name].azure_preempt(deadline)
            else:
                r = subprocess.run([str(Path(sys.executable).parent / "ray"), "drain-node", "--address",
                                    self.cluster.address, "--node-id", self.cluster.nodes[name].node_id, "--reason",
                                    "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "hetspot drill",
                                    "--deadline-remaining-seconds", str(max(1, int(f.deadline_s)))],
                                   capture_output=True, text=True, timeout=60)
                if r.returncode != 0:
                    raise RuntimeError(f"ray drain-node failed: {r.stderr.strip()[-300:]}")
        t = threading.Timer(f.deadline_s, self.kill, (list(f.nodes),))
        t.daemon = True
        t.start()
        self.timers.append(t)  # cancelled when the job ends first
        self._record(f, cloud=f.cloud, deadline_s=f.deadline_s)

    def _corrupt(self, f: Fault) -> None:
        from orchestrator.state.s3_store import S3Checkpoints

        self.c.store.flush()
        ck = self.job.checkpoint
        store = S3Checkpoints(ck.uri, ck.endpoint_url)
        done = store.complete_steps()
        if not done:
            self._record(f, damaged=None)
            return
        units = store.manifest(done[0])["units"]
        unit = f.unit if f.unit in units else sorted(units)[0]
        key = units[unit]["pieces"][0]["key"]
        bucket = key and store.bucket
        data = bytearray(store.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0x01
        store.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        self._record(f, damaged_step=done[0], key=key)

    # -- the result -----------------------------------------------------------------------------
    def _result(self, steps: int, reference: list[float], commits, wall: float, error: str | None,
                tokens: int) -> DrillResult:
        c = self.c
        losses = dict(c.progress.losses)
        diffs = [abs(losses[s] - want) / max(abs(want), 1e-12) for s, want in enumerate(reference) if s in losses]
        counts: dict[int, int] = {}
        for s, _, _ in commits:
            counts[s] = counts.get(s, 0) + 1
        lost = sum(n - 1 for n in counts.values())
        events = c.progress.events
        restores = [e for e in events if e["kind"] == "restore"]
        by_tier = {t: sum(e["bytes_by_tier"].get(t, 0) for e in restores if "bytes_by_tier" in e)
                   for t in ("live", "peer", "s3")}
        recoveries = recovery_timeline(events, commits)
        got = {"lost_steps": lost, "replans": sum(e["kind"] == "re-plan" for e in events),
               "drains": sum(e["kind"] == "drain" for e in events),
               "restores": len(restores),
               "refused_steps": sum(len(e.get("refused_steps", [])) for e in restores),
               "scale_ups": sum(e["kind"] == "scale-up" for e in events),
               "failed_uploads": sum(1 for u in c.store.uploads if u["error"]), "bytes_by_tier": by_tier,
               "final_nodes": sorted({st.node for p in c.plan.pipelines for st in p.stages}) if c.plan else []}
        final = {s: c.progress.samples.get(s, []) for s in range(steps)}
        useful = sum(c.progress.step_time_s.get(s, 0.0) for s in range(steps))
        res = DrillResult(
            name=self.sc.name, steps=steps, global_batch=c.train.global_batch, tokens_per_step=tokens, losses=losses,
            reference=list(reference), max_rel_diff=max(diffs, default=float("inf")), commits=commits, events=events,
            faults=self.fired, recoveries=recoveries, bytes_by_tier=by_tier, lost_steps=lost,
            samples=check_samples(final, steps, c.train.global_batch), wall_s=wall, useful_s=useful,
            uploads=list(c.store.uploads), error=error)
        res.expect_failures = check_expect(self.sc.expect, got) if error is None else []
        return res


def recovery_timeline(events: list[dict], commits: list[tuple[int, float, float]]) -> list[dict]:
    """Per re-plan or drain: detected, re-planned, restored and first step after it, in seconds since the start."""
    out = []
    for i, e in enumerate(events):
        if e["kind"] not in ("re-plan", "drain", "scale-up"):
            continue
        rest = events[i + 1:]
        nxt = next((k for k, x in enumerate(rest) if x["kind"] in ("re-plan", "drain", "scale-up")), len(rest))
        restore = next((x for x in rest[:nxt] if x["kind"] == "restore"), None)
        after = restore["t_s"] if restore else e["t_s"]
        first = next((t for s, t, _ in commits if t > after), None)
        row = {"kind": e["kind"], "cause": e["cause"][:120], "at_step": e["at_step"],
               "detected_s": e.get("detected_s", e.get("notice_s", e["t_s"])), "replanned_s": e.get("plan_s", e["t_s"]),
               "restored_s": restore["t_s"] if restore else None,
               "restore_step": restore["step"] if restore else None,
               "bytes_by_tier": restore.get("bytes_by_tier") if restore else None, "first_step_s": first}
        if e["kind"] == "drain":
            row["met_deadline"] = e.get("met_deadline")
        out.append(row)
    return out


def run_scenario(sc: Scenario, on_line: Callable[[str], None] | None = None) -> DrillResult:
    return Drill(sc, on_line=on_line).run()
