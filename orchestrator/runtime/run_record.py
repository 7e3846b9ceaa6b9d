"""A job's run record: what a user keeps after the cluster is gone (as Ray Train and torchtitan keep a result per run).

Where: beside the job's checkpoints, `<checkpoint.uri>/runs/<job id>/`, when the job has an S3 tier (another
machine reads it: `hetspot status s3://...`, `hetspot plot s3://...`); else a local directory,
`./hetspot-runs/<job id>/` where the driver runs (`HETSPOT_RUN_DIR` moves it).

What:
- `record.json`: the job file, the plans it ran under (each with the step it started at), every event (re-plans,
  drains, restores with bytes by tier, scale moves), the newest progress row, and a summary (steps committed,
  goodput, seconds recovering, lost steps, failed uploads, an ETA). Its size grows with events, not with steps,
  so `hetspot status` reads the same few kilobytes on a job of 20 steps or of 2,000.
- `data-index.json`: the training corpus's index (every shard with its size and version: S3's ETag, or a local
  file's digest), taken at submit (workers/corpus_index.py); the job in `record.json` names its data without it.
- `steps-NNNNNNNNNN.jsonl`: per committed step (loss, tokens/s, step time, seconds since the start), `CHUNK`
  steps a file; only the chunk being filled is rewritten. `hetspot status --history` and `hetspot plot` read them.
The controller writes it at most every `flush_every_s` seconds and at every event and at the end; a write that
fails (S3 down) is logged and retried at the next flush, never failing the job.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.errors import ConfigError

log = logging.getLogger("hetspot.run_record")
CHUNK = 1000  # steps per steps-*.jsonl file
RECORD = "record.json"
DATA_INDEX = "data-index.json"  # the corpus's shards with their sizes and versions, as the job indexed them
FORMAT = "hetspot-run/1"


def record_location(checkpoint_uri: str | None, job_id: str) -> str:
    """Where the run record of job `job_id` goes."""
    if checkpoint_uri:
        return f"{checkpoint_uri.rstrip('/')}/runs/{job_id}"
    return str(Path(os.environ.get("HETSPOT_RUN_DIR", "hetspot-runs")).resolve() / job_id)


class _Files:
    """Whole-file reads and writes under a run record's location: an S3 prefix or a local directory."""

    def __init__(self, location: str, endpoint_url: str | None = None):
        self.location = location
        self.s3 = location.startswith("s3://")
        if self.s3:
            from orchestrator.state.s3_store import new_client, parse_uri

            self.bucket, self.prefix = parse_uri(location)
            self.client = new_client(endpoint_url)
        else:
            self.dir = Path(location)

    def write(self, name: str, data: bytes) -> None:
        if self.s3:
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}", Body=data)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self.dir / name)  # a reader never sees half a file

    def read(self, name: str) -> bytes | None:
        """The file's bytes, None when it does not exist."""
        if not self.s3:
            p = self.dir / name
            return p.read_bytes() if p.is_file() else None
        from botocore.exceptions import ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"].read()
        except ClientError as e:
            if str(e.response.get("Error", {}).get("Code")) in ("NoSuchKey", "404", "NotFound"):
                return None
            raise


class RunRecordWriter:
    """Kept by the controller actor: rows and events in, files out (`flush`)."""

    def __init__(self, location: str, job: dict, job_id: str, steps: int, endpoint_url: str | None = None,
                 flush_every_s: float = 10.0, clock: Callable[[], float] = time.time,
                 data_index: dict | None = None) -> None:
        self.files = _Files(location, endpoint_url)
        self.data_index = data_index  # the corpus's index (data.index), written once beside the record
        self.location, self.clock, self.flush_every_s = location, clock, flush_every_s
        self.record: dict[str, Any] = {"format": FORMAT, "job_id": job_id, "job": job, "steps": steps,
                                       "started_at": clock(),
                       "state": "running", "error": None, "phase": None, "plans": [], "events": [], "progress": None,
                       "summary": {}}
        self.rows: dict[int, dict] = {}  # step -> row (a rolled-back step is replaced by its redo)
        self.dirty: set[int] = set()  # chunks to rewrite
        self.redone = 0  # committed steps trained again after a rollback
        self._flushed = 0.0

    def plan(self, plan: dict, from_step: int) -> None:
        self.record["plans"].append({"from_step": from_step, "plan": plan})
        self._flushed = 0.0  # at the next update

    def update(self, rows: list[dict], events: list[dict], state: str, error: str | None, now_s: float,
               phase: str | None = None) -> None:
        """Rows of newly committed steps, the events so far and the job's state, at `now_s` (the controller's
        seconds since its start, the clock of the events' times)."""
        for row in rows:
            s = row["step"]
            if s in self.rows:
                self.redone += 1
            self.rows[s] = {k: row[k] for k in ("step", "loss", "tokens_per_s", "step_time_s") if k in row} | {
                "t_s": round(now_s, 3)}
            self.dirty.add(s // CHUNK)
            self.record["progress"] = row
        changed = events != self.record["events"] or state != self.record["state"]
        self.record["events"] = json.loads(json.dumps(events, default=str))
        self.record["state"], self.record["error"], self.record["phase"] = state, error, phase
        if changed or self.clock() - self._flushed >= self.flush_every_s or state in ("done", "failed"):
            self.flush()

    def flush(self) -> None:
        self.record["summary"] = summarize(self.record, self.rows, self.redone)
        try:
            if self.data_index is not None:
                self.files.write(DATA_INDEX, json.dumps(self.data_index).encode())
                self.data_index = None
            for chunk in sorted(self.dirty):
                lines = [json.dumps(self.rows[s]) for s in sorted(self.rows) if s // CHUNK == chunk]
                self.files.write(f"steps-{chunk * CHUNK:010d}.jsonl", ("\n".join(lines) + "\n").encode())
            self.files.write(RECORD, json.dumps(self.record, default=str).encode())
        except Exception as e:  # noqa: BLE001 - the record must never fail the job; the next flush tries again
            log.warning("could not write the run record to %s: %s", self.location, e)
            return
        self.dirty.clear()
        self._flushed = self.clock()


def summarize(record: dict, rows: dict[int, dict], redone: int) -> dict:
    """Steps committed, goodput (time in committed steps over wall time), seconds recovering (a re-plan: from its
    detection to the end of the first step after it; a drain: the training stall at its switch), lost steps
    (committed steps trained again after a rollback), failed uploads, and an ETA at the median of the last 20
    step times. Event times are the controller's seconds since its start, as are the rows' `t_s`."""
    done = sorted((r["t_s"], r.get("step_time_s", 0.0)) for r in rows.values())
    wall = max((t for t, _ in done), default=0.0)
    recovering = 0.0
    for e in record["events"]:
        if e.get("kind") == "drain" and e.get("stall_s") is not None:
            recovering += e["stall_s"]
        elif e.get("kind") in ("re-plan", "drain"):
            start = e.get("detected_s", e.get("switch_s", e.get("t_s")))
            end = next((t for t, _ in done if t > e.get("t_s", 0.0)), None)
            recovering += max(0.0, end - start) if start is not None and end is not None else 0.0
    times = sorted(r["step_time_s"] for _, r in sorted(rows.items())[-20:] if "step_time_s" in r)
    last = max(rows, default=-1)
    left = max(0, record["steps"] - last - 1)
    progress = record.get("progress") or {}
    return {"committed_steps": len(rows), "last_step": last, "steps_left": left,
            "goodput": round(sum(dt for _, dt in done) / wall, 4) if wall > 0 else None,
            "recovering_s": round(recovering, 3), "lost_steps": redone,
            "re_plans": sum(e.get("kind") == "re-plan" for e in record["events"]),
            "drains": sum(e.get("kind") == "drain" for e in record["events"]),
            "failed_uploads": progress.get("failed_uploads", 0),
            "eta_s": round(left * times[len(times) // 2], 1) if times and record["state"] == "running" else None,
            "wall_s": round(wall, 3)}


# -- reading ------------------------------------------------------------------------------
def is_location(ref: str) -> bool:
    """Whether `ref` names a run record (an s3:// prefix or a path) rather than a Ray job id (which has no '/')."""
    return ref.startswith("s3://") or "/" in ref or os.sep in ref or Path(ref).is_dir()


def read_record(location: str, endpoint_url: str | None = None) -> dict:
    """The run record at `location`; ConfigError (exit 2) when there is none."""
    try:
        data = _Files(location, endpoint_url).read(RECORD)
    except ValueError as e:  # a malformed s3:// URI
        raise ConfigError(f"{location}: {e}") from None
    except Exception as e:  # noqa: BLE001 - S3 unreachable, no credentials: say where and what
        raise ConfigError(f"{location}: cannot read the run record ({type(e).__name__}: {e}); check the "
                          "address, the credentials and --endpoint-url") from None
    if data is None:
        raise ConfigError(f"{location}: no run record there ({RECORD} is missing); a job writes one to "
                          "<checkpoint.uri>/runs/<job id>/ or, without a checkpoint, to ./hetspot-runs/<job id>/")
    rec = json.loads(data)
    if rec.get("format") != FORMAT:
        raise ConfigError(f"{location}: {RECORD} is not a hetspot run record (format {rec.get('format')!r})")
    return rec


def read_steps(location: str, record: dict, endpoint_url: str | None = None) -> list[dict]:
    """Every committed step's row, oldest first."""
    files = _Files(location, endpoint_url)
    last = record["summary"].get("last_step", -1)
    out: list[dict] = []
    for start in range(0, last + 1, CHUNK):
        data = files.read(f"steps-{start:010d}.jsonl")
        if data:
            out += [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return out
