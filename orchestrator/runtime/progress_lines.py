"""The line protocol between a job's driver and `hetspot status`: prefixes, env names, parsing.

The driver (orchestrator/driver.py) prints one `hetspot-progress {json}` line per
committed step and one `hetspot-phase {json}` line whenever the job's phase
changes (placing, restoring, training, ...), and a `hetspot-events [json]`
line (every re-plan, drain and restore so far, with its timeline) whenever
that list changes; `hetspot status` reads the newest of each from the job log.
Pure: no Ray.
"""

from __future__ import annotations

import json
from typing import Any

PROGRESS = "hetspot-progress "
PHASE = "hetspot-phase "
EVENTS = "hetspot-events "
ENV_JOB, ENV_STEPS, ENV_ID = "HETSPOT_JOB_SPEC", "HETSPOT_STEPS", "HETSPOT_SUBMISSION_ID"
ENV_RESUME = "HETSPOT_RESUME"


def progress_line(row: dict) -> str:
    return PROGRESS + json.dumps(row)


def phase_line(phase: str, elapsed_s: float) -> str:
    return PHASE + json.dumps({"phase": phase, "elapsed_s": round(elapsed_s, 3)})


WORKER_LINE = " hetspot.worker "  # structured worker lines (workers/logs.py)


def dedupe_worker_lines(text: str, seen: set[str] | None = None) -> str:
    """Drop repeated copies of structured worker lines.

    When several Ray nodes share one host (a test cluster, or `ray start` twice on
    one machine), each node's log monitor forwards the same worker log file, so
    every worker line reaches the job log once per node. A worker line carries its
    process and a millisecond timestamp, so an exact repeat is a copy. `seen` keeps
    the state across chunks of a followed log.
    """
    seen = set() if seen is None else seen
    out = []
    for line in text.splitlines(keepends=True):
        if WORKER_LINE in line:
            if line in seen:
                continue
            seen.add(line)
        out.append(line)
    return "".join(out)


def events_line(events: list[dict]) -> str:
    return EVENTS + json.dumps(events)


def last_events(logs: str) -> list[dict]:
    """The job's re-plans, drains and restores with their timelines, from the newest events line."""
    events = _last(logs, EVENTS)
    return events if isinstance(events, list) else []


def _found(line: str, prefix: str) -> Any:
    """The JSON after `prefix` in `line`, wherever the prefix stands and whatever follows the JSON (another
    thread's output forwarded into the same log may share its line); None when there is none."""
    i = line.find(prefix)
    if i < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(line, i + len(prefix))[0]
    except json.JSONDecodeError:
        return None


def _last(logs: str, prefix: str) -> Any:
    for line in reversed(logs.splitlines()):
        got = _found(line, prefix)
        if got is not None:
            return got
    return None


def progress_rows(logs: str) -> list[dict]:
    """Every committed step's row in a job log, in order (a follower's or a test's whole view): each progress
    line's JSON wherever it stands, two on one line included (another process's partial output, a line without
    its newline, can run into one)."""
    rows, decoder, at = [], json.JSONDecoder(), logs.find(PROGRESS)
    while at >= 0:
        try:
            row, _ = decoder.raw_decode(logs, at + len(PROGRESS))
            if isinstance(row, dict):
                rows.append(row)
        except json.JSONDecodeError:
            pass
        at = logs.find(PROGRESS, at + 1)
    return rows


def last_progress(logs: str) -> dict | None:
    """The newest committed step's row in a job log, or None."""
    return _last(logs, PROGRESS)


def last_phase(logs: str) -> dict | None:
    """The newest phase line in a job log, or None."""
    return _last(logs, PHASE)
