"""Spot-preemption traces (pure): Parcae's JSON-lines format, checked line by line, and two mappings.

A trace line is `[t_ms, event, {"nodes": [...], ...}]` with `event` one of add,
remove, no-op, migration; other keys are ignored. Times must not go back, a
removed node must be up, an added one down.

Mapping onto a drill's test cluster (`drill_events`), the documented rule:
  - the test cluster has K slots (default 6), slot k of GPU type MIX[k mod 3] (L4, T4, T4);
  - trace node `node-i` maps to slot i mod K;
  - every `remove` preempts ceil(len(nodes) * K / N0) up slots (N0: the nodes of
    the trace's first add), at least one: the mapped slots first, then the next
    up slots in slot order; the last up slot is never taken (the event is then
    reported as skipped);
  - every `add` starts the same number of down slots, mapped ones first; a slot
    that comes back is a new node (`<slot>-r<n>`), as a replacement spot VM is;
  - time is divided by `time_scale` (default 20: one hour in three minutes).

Mapping onto a fleet for `hetspot simulate` (`fleet_slots`): fleet node j belongs
to slot j mod N0; a slot is up while at least one trace node mapped to it
(`node-i` -> i mod N0) is up.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ConfigError
from planner import ClusterSpec

EVENTS = ("add", "remove", "no-op", "migration")
MIX = ("L4", "T4", "T4")  # with the trace job, every slot gets a share (asymmetric: L4 58, T4 35 samples)


@dataclass(frozen=True)
class TraceEvent:
    t_s: float
    kind: str  # add or remove
    nodes: tuple[str, ...]
    line: int


@dataclass
class Trace:
    source: str
    events: list[TraceEvent]
    end_s: float  # the last line's time plus its duration
    first_nodes: int  # the nodes of the first add

    @property
    def peak(self) -> int:
        up, best = 0, 0
        for e in self.events:
            up += len(e.nodes) if e.kind == "add" else -len(e.nodes)
            best = max(best, up)
        return best


def _number(name: str) -> int:
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else sum(name.encode())


def load_trace(path: str | Path) -> Trace:
    p = Path(path)
    if p.is_dir() or not p.is_file():
        raise ConfigError(f"trace {str(p)!r} {'is a directory' if p.is_dir() else 'does not exist'}; pass a JSON-lines "
                          "spot trace ([t_ms, event, {\"nodes\": [...]}] per line)")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); a trace is JSON lines") from None
    return parse_trace(text, str(p))


def parse_trace(text: str, source: str = "<trace>") -> Trace:
    events: list[TraceEvent] = []
    up: set[str] = set()
    last_t, end, first = -1.0, 0.0, 0
    fix = 'each line must be [t_ms, "add"|"remove"|"no-op"|"migration", {"nodes": ["node-0", ...]}]'
    for no, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ConfigError(f"{source}: line {no}: not JSON ({getattr(e, 'msg', e)}); {fix}") from None
        if not (isinstance(row, list) and len(row) >= 2 and isinstance(row[0], int | float)
                and not isinstance(row[0], bool) and isinstance(row[1], str)):
            raise ConfigError(f"{source}: line {no}: {raw[:60]!r} is not a trace row; {fix}")
        t_ms, kind = row[0], row[1]
        info = row[2] if len(row) > 2 else {}
        if kind not in EVENTS:
            raise ConfigError(f"{source}: line {no}: unknown event {kind!r}; use one of {', '.join(EVENTS)}")
        if not math.isfinite(t_ms) or t_ms < 0:
            raise ConfigError(f"{source}: line {no}: time {t_ms!r} must be a finite number of milliseconds >= 0")
        if t_ms < last_t:
            raise ConfigError(f"{source}: line {no}: time {t_ms} ms goes back (previous line {last_t:.0f} ms); "
                              "sort the trace by time")
        if not isinstance(info, dict) or not isinstance(info.get("nodes", []), list) or \
                not all(isinstance(n, str) for n in info.get("nodes", [])):
            raise ConfigError(f"{source}: line {no}: the third item must be an object with \"nodes\": a list of names")
        nodes = tuple(info.get("nodes", []))
        last_t = t_ms
        dur = info.get("duration", 0)
        end = max(end, t_ms + (dur if isinstance(dur, int | float) and not isinstance(dur, bool) else 0))
        if kind == "add":
            again = sorted(set(nodes) & up)
            if again:
                raise ConfigError(f"{source}: line {no}: adds {again[0]}, which is already up; remove it first or "
                                  "drop it from this line")
            up |= set(nodes)
            first = first or len(nodes)
        elif kind == "remove":
            gone = sorted(set(nodes) - up)
            if gone:
                raise ConfigError(f"{source}: line {no}: removes {gone[0]}, which is not up; add it on an earlier "
                                  "line or drop it from this one")
            up -= set(nodes)
        if kind in ("add", "remove") and nodes:
            events.append(TraceEvent(t_ms / 1000, kind, nodes, no))
    if not events or events[0].kind != "add":
        raise ConfigError(f"{source}: the trace must start with an add event (the fleet's first nodes)")
    return Trace(source, events, end / 1000, first)


@dataclass(frozen=True)
class DrillEvent:
    t_s: float  # scaled
    kind: str  # preempt, add-node, or skipped
    slots: tuple[int, ...]
    trace_line: int
    trace_t_s: float


def drill_events(trace: Trace, k: int = 6, time_scale: float = 20.0) -> list[DrillEvent]:
    """The trace's adds and removes after the first, as slot events on K test nodes (rule in the docstring)."""
    up = set(range(k))
    out = []
    for e in trace.events[1:]:
        n = max(1, math.ceil(len(e.nodes) * k / max(1, trace.first_nodes)))
        mapped = [_number(x) % k for x in e.nodes]
        order = list(dict.fromkeys(mapped + list(range(k))))
        if e.kind == "remove":
            pick = [s for s in order if s in up][:min(n, len(up) - 1)]
            up -= set(pick)
            kind = "preempt" if pick else "skipped"
        else:
            pick = [s for s in order if s not in up][:n]
            up |= set(pick)
            kind = "add-node" if pick else "skipped"
        out.append(DrillEvent(e.t_s / time_scale, kind, tuple(pick), e.line, e.t_s))
    return out


def fleet_slots(trace: Trace) -> list[tuple[float, str, set[int]]]:
    """[(t_s, add|remove, slots that changed)]: slot = trace node number mod N0; up while one of its nodes is up."""
    n0 = max(1, trace.first_nodes)
    count: dict[int, int] = {}
    out = []
    for e in trace.events:
        changed = set()
        for x in e.nodes:
            s = _number(x) % n0
            before = count.get(s, 0)
            count[s] = before + (1 if e.kind == "add" else -1)
            if (before == 0) != (count[s] == 0):
                changed.add(s)
        if changed:
            out.append((e.t_s, e.kind, changed))
    return out


TRACE_JOB = {
    "name": "trace-replay",
    "model": {"name": "gpt-trace", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 64,
              "seq_len": 64},
    "train": {"global_batch": 256, "lr": 0.01, "precision": "fp32"},
    "runtime": {"dtype": "float64", "emulate_speed": False, "collective_timeout_s": 30, "snapshot_every": 1,
                "scale_check_every": 2},
    # S3 every 20 steps: uploads of every few steps would queue up faster than the test machine sends them
    "checkpoint": {"uri": "s3://hetspot-drill/trace", "s3_every": 20, "keep": 2},
    "steps": 1,
}


def trace_scenario(trace: Trace, k: int = 6, time_scale: float = 20.0, job: dict | None = None):
    """A drill Scenario for the trace: K single-GPU slots of mixed types, every slot event a timed fault."""
    from orchestrator.drills.scenario import Fault, Scenario
    from orchestrator.job_spec import parse_job

    if k < 2:
        raise ConfigError(f"--nodes {k}: a trace replay needs at least 2 test nodes (one must stay up)")
    if not time_scale > 0:
        raise ConfigError(f"--time-scale {time_scale}: must be > 0 (20 replays an hour in 3 minutes)")
    events = drill_events(trace, k, time_scale)
    gen = [0] * k
    name = [f"slot{s}-{MIX[s % len(MIX)].split('-')[0].lower()}" for s in range(k)]
    current = list(name)
    nodes = [{"name": n, "gpu_type": MIX[s % len(MIX)], "num_gpus": 1, "inter_node_bw_gb_s": 10}
             for s, n in enumerate(name)]
    faults = []
    for e in events:
        if e.kind == "skipped":
            continue
        names = []
        for s in e.slots:
            if e.kind == "add-node":
                gen[s] += 1
                current[s] = f"{name[s]}-r{gen[s]}"
                nodes.append({"name": current[s], "gpu_type": MIX[s % len(MIX)], "num_gpus": 1,
                              "inter_node_bw_gb_s": 10})
            names.append(current[s])
        faults.append(Fault(kind=e.kind, at_s=round(e.t_s, 3), nodes=names, line=e.trace_line))
    spec = dict(job or TRACE_JOB) | {"cluster": {"nodes": nodes}}
    j = parse_job(spec, "trace job")
    return Scenario(name=f"trace {Path(trace.source).name}", job=j, faults=faults), events


def read_yaml(path, what: str, see: str):
    """(the path, its YAML) for a file the user named; a missing, unreadable or non-YAML file is a ConfigError
    naming it and `see` (exit 2)."""
    import yaml

    p = Path(path)
    if p.is_dir() or not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} {'is a directory' if p.is_dir() else 'does not exist'}; see {see}")
    try:
        return p, yaml.safe_load(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        raise ConfigError(f"{p}: not a readable YAML {what} ({type(e).__name__}); see {see}") from None


def load_fleet(path) -> ClusterSpec:
    """A fleet file: `nodes:` as in a job's cluster, or `fleet:` groups of identical nodes
    ({gpu_type, nodes: count, num_gpus, inter_node_bw_gb_s, market, price_per_hour}) named <type>-<i>."""

    from pydantic import ValidationError

    from orchestrator.job_spec import format_validation

    p, data = read_yaml(path, "fleet file", "examples/fleets/")
    if not isinstance(data, dict) or not ({"nodes", "fleet"} & set(data)):
        raise ConfigError(f"{p}: a fleet file has nodes: (a job's cluster) or fleet: (groups with a count)")
    if "fleet" in data:
        groups = data.pop("fleet")
        if not isinstance(groups, list):
            raise ConfigError(f"{p}: field 'fleet': a list of groups such as {{gpu_type: L4, nodes: 16, num_gpus: 8}}")
        nodes = []
        for i, g in enumerate(groups):
            if not isinstance(g, dict) or not isinstance(g.get("nodes"), int) or isinstance(g.get("nodes"), bool) \
                    or not 1 <= g["nodes"] <= 4096:
                raise ConfigError(f"{p}: field 'fleet.{i}.nodes': a count of nodes from 1 to 4096")
            spec = {k: v for k, v in g.items() if k != "nodes"}
            tag = str(spec.get("gpu_type", "gpu")).lower()
            nodes += [spec | {"name": f"{tag}-{i}-{j:03d}"} for j in range(g["nodes"])]
        data["nodes"] = nodes
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation(str(p), e, "fleet file")) from None
