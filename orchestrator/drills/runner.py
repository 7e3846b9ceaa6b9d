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
expectations (lost steps, re-plans, bytes per tier, ...) hold. The reference is
the job's first plan throughout ("fixed"), or the plans the drill committed each
step under, run without faults after the drill ("replayed", replay.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from orchestrator.drills.inject import FaultInjection, S3Server
from orchestrator.drills.results import DrillResult, check_samples, recovery_timeline
from orchestrator.drills.scenario import Fault, Scenario, check_expect
from orchestrator.errors import ConfigError
from orchestrator.job_spec import CheckpointSpec, JobSpec
from planner import ClusterSpec, NodeSpec, Plan

log = logging.getLogger("hetspot.drill")
REFERENCES = ("fixed", "replayed")  # the reference run: the first plan throughout, or the drill's plans (replay.py)
BUCKET = "hetspot-drill"
JOIN_WAIT_S = 120.0  # the longest a trace's end waits for a chosen move's warm workers (Drill._join_waits)
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


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


class Drill(FaultInjection):
    """One scenario on a fresh embedded cluster (or `cluster`, an EmbeddedCluster already connected)."""

    def __init__(self, sc: Scenario, cluster=None, s3: S3Server | None = None,
                 on_line: Callable[[str], None] | None = None, reference: str = "fixed"):
        for k, v in CREDS.items():
            os.environ.setdefault(k, v)  # the nodes' processes read S3 with these, as with an instance role
        if reference not in REFERENCES:
            raise ConfigError(f"--reference {reference!r}: use one of {', '.join(REFERENCES)}")
        self.sc, self.say, self.reference_kind = sc, on_line or (lambda m: None), reference
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
        self.main_queue: list[Fault] = []
        self.threads: list[threading.Thread] = []
        self.lags: list[dict] = []  # the S3 tier's standing at each commit (TieredState.upload_lag)
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
        # A shared cluster keeps an earlier drill's idle nodes (_release): one this drill starts with, declared
        # alike, is used as it is; every other one goes, so the job sees exactly its first nodes.
        want = {n.name: (n, {}) for n in first if n.name not in self.imds}
        kept = {x for x, d in self.cluster.declared.items() if want.get(x) == d}
        self.kill([x for x in self.cluster.nodes if x not in kept])
        for n in first:
            if n.name not in kept:
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
        from orchestrator.control.controller import State
        from orchestrator.runtime.controller_actor import make_controller

        j = self.job.model_copy(update={"checkpoint": None, "runtime": self.job.runtime.model_copy(
            update={"notices": "none", "scale_check_every": 0})})
        present = ClusterSpec(nodes=[n for n in j.cluster.nodes if n.name in self.cluster.nodes])
        c = make_controller(j, steps, nodes=DeclaredNodes(present))
        self.say(f"reference run: {steps} steps without faults")
        if c.run() != State.DONE:
            raise RuntimeError(f"the reference run failed: {c.error}")
        return [c.progress.losses[s] for s in range(steps)], c.progress.samples

    def run(self, reference: list[float] | None = None, steps: int | None = None, timed: list[Fault] | None = None,
            until_s: float | None = None, commits_after_faults: int = 0) -> DrillResult:
        """The fixed reference run, then the drill (then the replayed reference, or the fixed one after a trace).
        `until_s`: end the job at the first commit after this time (traces); with `commits_after_faults`, not
        before every timed fault has fired and that many steps were committed after the last one (so what a test
        checks of a trace does not depend on how many steps a slow machine fits in the trace's time)."""
        from orchestrator.cluster.node_sources import DeclaredNodes
        from orchestrator.control.controller import State
        from orchestrator.runtime.controller_actor import make_controller
        from planner.specs import tokens_per_step

        steps = steps or self.job.steps
        error, commits, wall = None, [], 0.0
        plans: dict[int, Plan] = {}  # the plan each step was (last) committed under
        replayed = self.reference_kind == "replayed"
        try:
            self._start_nodes()
            if reference is None and until_s is None and not replayed:
                reference, _ = self.reference(steps)
            self.nodes = DeclaredNodes(self.job.cluster)
            self.recovery_armed: list[str] | None = None
            self.join_wait_since: float | None = None
            self.c = c = make_controller(self.job, steps if until_s is None else 10**9, nodes=self.nodes,
                                         on_phase=self._on_phase, first_plan=self.sc.plan)
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
                while self.main_queue:  # timed faults that must run on the main thread (a node joining)
                    self._fire(self.main_queue.pop(0))
                if c.state == State.TRAINING:
                    while by_step and by_step[0].at_step <= c.progress.committed + 1:
                        after_commit += self._fire(by_step.pop(0)) or []
                plan = c.plan  # a scale-up after the commit changes c.plan within the same call
                c.step()
                if c.progress.committed != last:
                    if c.progress.committed > last:
                        s = c.progress.committed
                        plans[s] = plan
                        commits.append((s, c.clock.now() - c.started_at, c.progress.step_time_s.get(s, 0.0)))
                        self.lags.append(c.store.upload_lag(s))
                        for at, action in [a for a in after_commit if a[0] <= s]:
                            after_commit.remove((at, action))
                            action()
                    last = c.progress.committed
                if until_s is not None and time.monotonic() - self.t0 >= until_s \
                        and c.steps > c.progress.committed + 1 \
                        and self._faults_settled(len(timed or []) + sum(f.at_s is not None for f in self.sc.faults),
                                                 commits, commits_after_faults) \
                        and not self._join_waits(c):
                    c.finish_after(c.progress.committed + 1)
            if c.state == State.FAILED:
                error = c.error
            wall = c.clock.now() - c.started_at
            self.s3_not_good = self._audit_s3()
        except BaseException:
            self._stop()
            self._release()
            raise
        self._stop()
        try:
            if error is None and (until_s is not None or replayed):
                steps = c.progress.committed + 1 if until_s is not None else steps
                reference = self.replayed(plans, steps) if replayed else self.reference(steps)[0]
        finally:
            self._release()
        return self._result(steps, reference or [], commits, wall, error,
                            tokens_per_step(c.model, c.train.global_batch))

    def _join_waits(self, c) -> bool:
        """A move onto joined nodes is chosen and waits for their warm workers (training goes on meanwhile): a
        trace's end waits for it too, up to JOIN_WAIT_S, so what a drill checks of a join does not depend on how
        long a process start takes on a loaded machine."""
        if not c.join_pending:
            self.join_wait_since = None
            return False
        if self.join_wait_since is None:
            self.join_wait_since = time.monotonic()
        return time.monotonic() - self.join_wait_since < JOIN_WAIT_S

    def _faults_settled(self, num_timed: int, commits: list, after: int) -> bool:
        """Every timed fault has fired and `after` commits followed the last one (0: no wait)."""
        if after <= 0:
            return True
        fired = [f["injected_s"] for f in self.fired]
        if len(fired) < num_timed:
            return False
        last = max(fired, default=0.0)
        return sum(t > last for _, t, _ in commits) >= after

    def _audit_s3(self) -> list[str]:
        """What the job's prefix holds at the end that is not a whole, readable step of its own: each refused step
        with why, and each half-written folder behind the newest good step."""
        s3 = getattr(self.c.store, "s3", None)
        if s3 is None:
            return []
        listing = s3._listing()
        statuses = s3.survey(self.c.store.identity, listing=listing)
        out = [f"step {st.step}: {st.reason}" for st in statuses if not st.ok]
        good = [st.step for st in statuses if st.ok]
        out += [f"step {i.step}: half-written ({i.num_objects} objects, no manifest)" for i in s3.steps(listing)
                if not i.complete and good and i.step < good[0]]
        return out

    def replayed(self, plans: dict[int, Plan], steps: int) -> list[float]:
        """The drill's plans, step for step, without faults (replay.py), on the nodes up now and like ones."""
        from orchestrator.drills.replay import place, plan_segments, replay

        segments = plan_segments(plans, steps)
        declared = {n.name: n for n in self.job.cluster.nodes}
        alive = [n for n in self.cluster.nodes if n in declared]
        added, placed = place([p for _, _, p in segments], list(declared.values()), alive)
        for n in added:
            self._add(n)
        self.say(f"reference run: the drill's {steps} steps on its {len(segments)} plan(s), without faults")
        job = self.job.model_copy(update={"checkpoint": None, "cluster": ClusterSpec(
            nodes=[declared[n] for n in alive] + added)})
        return replay(job, [(a, b, p) for (a, b, _), p in zip(segments, placed, strict=True)], self.say)[0]

    def _stop(self) -> None:
        for t in self.timers:
            t.cancel()
        for t in self.threads:
            t.join(timeout=120)
        for s in self.imds.values():
            s.stop()
        if self.own_s3:
            self.s3.stop()

    def _release(self) -> None:
        if self.own_cluster:
            self.cluster.shutdown()
        else:  # a shared cluster: the nodes left idle stay for the next drill (one without a notice, no actor left)
            noticed = {n for f in self.sc.faults if f.kind == "notice" for n in f.nodes}
            idle = self.cluster.idle([x for x in self.cluster.nodes if x not in noticed])
            self.kill([x for x in self.cluster.nodes if x not in idle])

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
                   for t in ("live", "peer", "s3")} | {"in_place": sum(e.get("in_place_bytes", 0) for e in restores)}
        recoveries = recovery_timeline(events, commits)
        end = c.store.upload_lag(c.progress.committed)
        got = {"lost_steps": lost, "replans": sum(e["kind"] == "re-plan" for e in events),
               "drains": sum(e["kind"] == "drain" for e in events),
               "restores": len(restores),
               "refused_steps": sum(len(e.get("refused_steps", [])) for e in restores),
               "scale_ups": sum(e["kind"] == "scale-up" for e in events),
               "warmed": sum(e.get("new_workers", 0) for e in events  # started before they were needed
                             if e["kind"] == "warm-at-join" or (e["kind"] in ("drain", "scale-up") and "ready_s" in e)),
               "failed_uploads": sum(1 for u in c.store.uploads if u.error), "bytes_by_tier": by_tier,
               "s3_last_step": end["newest_step"] == steps - 1, "s3_not_good": getattr(self, "s3_not_good", []),
               "final_nodes": c.plan.nodes() if c.plan else []}
        final = {s: c.progress.samples.get(s, []) for s in range(steps)}
        useful = sum(c.progress.step_time_s.get(s, 0.0) for s in range(steps))
        res = DrillResult(
            name=self.sc.name, steps=steps, global_batch=c.train.global_batch, tokens_per_step=tokens, losses=losses,
            reference=list(reference), max_rel_diff=max(diffs, default=float("inf")), commits=commits, events=events,
            faults=self.fired, recoveries=recoveries, bytes_by_tier=by_tier, lost_steps=lost,
            samples=check_samples(final, steps, c.train.global_batch), wall_s=wall, useful_s=useful,
            uploads=list(c.store.uploads), error=error, reference_kind=self.reference_kind,
            upload_lag=upload_summary(self.lags, end), final_nodes=got["final_nodes"], sample_ranges=final,
            val_losses=dict(c.progress.val_losses))
        res.expect_failures = check_expect(self.sc.expect, got) if error is None else []
        return res


def upload_summary(lags: list[dict], end: dict) -> dict:
    """The S3 tier over a drill: the largest lag (steps since the newest step in S3) and backlog (uploads in
    flight or waiting) seen at a commit, and at the end the newest step, dropped and failed uploads."""
    return {"max_lag_steps": max((x["lag_steps"] for x in lags), default=0),
            "max_backlog": max((x["backlog"] for x in lags), default=0)} | {
        k: end[k] for k in ("newest_step", "dropped", "failed")}


def run_scenario(sc: Scenario, on_line: Callable[[str], None] | None = None) -> DrillResult:
    return Drill(sc, on_line=on_line).run()
