"""Fault injection for drills: the S3 server that can go down, and the faults as a mixin of `Drill`.

Step-bound faults land at exact points because the drill steps the controller
itself: a kill's ranks stall inside the step first (so it lands mid-step), an
upload is held in the keepers, a second kill waits for the recovery's restore.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from orchestrator.drills.scenario import Fault

log = logging.getLogger("hetspot.drill")


class S3Server:
    """moto's threaded S3 server behind the drills' fault proxy (orchestrator/drills/s3_proxy.py): jobs reach
    it at `url`, the proxy's. `outage(s)` stops moto and starts it again on the same port (state kept; the
    proxy drops connections meanwhile); `slowdown(s)` has the proxy answer 503 SlowDown; `proxy.delay_s` slows
    every request."""

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
        self.backend_url = f"http://{host}:{self.port}"
        from orchestrator.drills.s3_proxy import S3FaultProxy

        self.proxy = S3FaultProxy(self.backend_url)
        self.url = self.proxy.url
        self.down_s = 0.0

    def bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.backend_url, region_name="us-east-1").create_bucket(Bucket=name)

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

    def slowdown(self, seconds: float) -> None:
        self.proxy.slowdown(seconds)

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()


class FaultInjection:
    """The faults of drills/ (orchestrator/drills/scenario.py KINDS); a Drill provides c, cluster, s3, job."""

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
            if f.at_step is not None:
                self._quiet_state_plane()
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
            ray.get([k.hold_uploads.remote() for k in c.store.keepers.values()])  # until the kill, however long
            step = c.progress.committed + 1

            def kill_mid_upload() -> None:
                self.kill(f.nodes)
                for name, k in list(c.store.keepers.items()):
                    if name not in f.nodes:
                        ray.get(k.release_uploads.remote())
                self._record(f, upload_step=step)
            return [(step, kill_mid_upload)]
        elif f.kind == "corrupt-s3":
            self._corrupt(f)
        elif f.kind == "expire-s3":
            self._expire(f)
        elif f.kind == "s3-outage":
            self.threads.append(self.s3.outage(f.for_s))
            self._record(f, for_s=f.for_s)
        elif f.kind == "s3-slowdown":
            self.s3.slowdown(f.for_s)
            self._record(f, for_s=f.for_s)
        elif f.kind == "add-node":
            if threading.current_thread() is not threading.main_thread():
                self.main_queue.append(f)  # Ray starts a node only from the main thread: the drill loop does it
                return None
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

    def _quiet_state_plane(self) -> None:
        """A kill at a step lands on a quiet state plane: the committed step's peer copies in the keepers and the
        S3 uploads asked for ended (written or failed). What a scenario expects of the kill (bytes per tier, no
        failed upload) then does not hang on how fast a loaded machine copies and uploads; training never waits
        for either. A kill racing them is what preempt-during-upload and a trace drill's timed faults do."""
        try:
            self.c.store.wait_snapshots(timeout_s=60.0)
            self.c.store.flush()
        except Exception as e:  # noqa: BLE001 - a copy's node already gone, or S3 still refusing: the kill goes on
            log.info("the state plane was not quiet before the kill (%s: %s)", type(e).__name__, e)

    def _stall(self, nodes: list[str], step: int) -> None:
        """The nodes' ranks stall inside `step`, so the kill lands mid-step (their peers wait in a collective)."""
        import ray

        g = self.c.group
        if g is None or not hasattr(g, "run"):
            return
        from planner import layout

        try:  # a group being replaced, or a rank already gone: the kill alone still lands
            ranks = layout.ranks(g.plan)
            refs = [g.run.workers[i].inject_fault.remote(step, "hang") for i, r in enumerate(ranks) if r.node in nodes]
            if refs:
                ray.get(refs, timeout=30)
        except Exception as e:
            log.info("could not stall %s inside step %d (%s); killing without it", nodes, step, type(e).__name__)

    def _on_phase(self, phase: str) -> None:
        armed = getattr(self, "recovery_armed", None)
        if phase == "restoring state" and armed is not None and self.c.progress.restarts:
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

    def _newest_s3_step(self):
        """(the job's S3 store, its newest complete step or None), once the uploads in hand have landed."""
        from orchestrator.state.s3_store import S3Checkpoints

        self.c.store.flush()
        ck = self.job.checkpoint
        store = S3Checkpoints.at(ck.location)
        done = store.complete_steps()
        return store, done[0] if done else None

    def _expire(self, f: Fault) -> None:
        """A lifecycle rule on the newest complete step: every piece goes, the manifest (written last) stays."""
        store, step = self._newest_s3_step()
        if step is None:
            self._record(f, expired=None)
            return
        keys = [p["key"] for u in store.manifest(step)["units"].values() for p in u["pieces"]]
        store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys]})
        self._record(f, expired_step=step, objects=len(keys))

    def _corrupt(self, f: Fault) -> None:
        store, step = self._newest_s3_step()
        if step is None:
            self._record(f, damaged=None)
            return
        units = store.manifest(step)["units"]
        unit = f.unit if f.unit in units else sorted(units)[0]
        key = units[unit]["pieces"][0]["key"]
        bucket = key and store.bucket
        data = bytearray(store.client.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[len(data) // 2] ^= 0x01
        store.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
        self._record(f, damaged_step=step, key=key)
