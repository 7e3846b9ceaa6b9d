"""Drill scenario files (pure: YAML and pydantic, no Ray, no boto3).

A scenario names a job (inline, or a job file relative to the scenario), the
faults to inject, each at a step or a time, and what the recovery must show:

    name: preempt-mid-step
    job: {model: ..., train: ..., cluster: {nodes: [...]}, steps: 6}
    faults:
      - {kind: preempt, at_step: 3, nodes: [l4-a]}
    expect: {lost_steps: 0, replans: 1, bytes: {s3: 0, in_place: ">0"}}

Fault kinds (`KINDS`): preempt (hard kill; at a step the committed step's peer
copies land and the uploads asked for end, then the node's ranks stall inside
that step, so the kill lands mid-step), notice (a cloud spot notice
through the node's fake metadata service, or a Ray drain; the node is killed at
`deadline_s`), preempt-during-upload (the step's S3 upload is held in the
keepers when the node dies), preempt-during-recovery (`then` nodes die while
the first recovery restores state), corrupt-s3 (one byte flipped in the newest
complete S3 step), expire-s3 (every piece of the newest complete S3 step
deleted, its manifest left: what a lifecycle rule does, the manifest being
written last), s3-outage (the S3 endpoint stops for `for_s` seconds),
s3-slowdown (every S3 request is answered 503 SlowDown for `for_s` seconds, as a
real bucket throttles), and add-node (declared nodes that start absent and join).

Every error names the scenario's line and the fix (exit code 2 from the CLI).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.errors import ConfigError
from orchestrator.job_spec import JobSpec, _cluster_file, _read_yaml, format_validation, parse_job
from planner import Plan

KINDS = ("preempt", "notice", "preempt-during-upload", "preempt-during-recovery", "corrupt-s3", "expire-s3",
         "s3-outage", "s3-slowdown", "add-node")
NEEDS_NODES = {"preempt", "notice", "preempt-during-upload", "preempt-during-recovery", "add-node"}
TIER_NAMES = ("live", "peer", "s3")


class Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str
    at_step: int | None = Field(default=None, ge=1, description="inject before (or inside) this step")
    at_s: float | None = Field(default=None, ge=0, description="inject this many seconds after the job starts")
    nodes: list[str] = []
    cloud: Literal["aws", "gcp", "azure", "ray"] = "aws"
    deadline_s: float = Field(default=20.0, gt=0, le=600, description="notice: seconds until the node is killed")
    then: list[str] = Field(default=[], description="preempt-during-recovery: killed while the first recovery "
                            "restores state; default: a node of the new plan")
    for_s: float = Field(default=5.0, gt=0, le=600,
                         description="s3-outage, s3-slowdown: seconds without S3, or of 503 SlowDown")
    unit: str | None = Field(default=None, description="corrupt-s3: the unit to damage; default the first")
    line: int = 0  # the scenario line it came from (set by the loader)


class Expect(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lost_steps: int | None = Field(default=None, ge=0, description="committed steps redone")
    replans: int | None = Field(default=None, ge=0)
    drains: int | None = Field(default=None, ge=0)
    restores: int | None = Field(default=None, ge=0)
    refused_steps: int | None = Field(default=None, ge=0, description="damaged S3 steps refused")
    scale_ups: int | None = Field(default=None, ge=0)
    warmed: int | None = Field(default=None, ge=0, description="workers started before they were needed: at a "
                               "node's join (warm at join), and by pre-staged switches (a notice's drain, a join's "
                               "move) that found them ready, while the old plan trained")
    failed_uploads: str | int | None = Field(default=None, description="count, or '>0'")
    final_nodes: list[str] | None = Field(default=None, description="the nodes the last plan trains on")
    s3_last_step: bool | None = Field(default=None, description="true: the job's last step is in S3 at the end, "
                                      "whole (no fault kept the newest state from landing)")
    s3_good_only: bool | None = Field(default=None, description="true: at the end the job's prefix holds only "
                                      "whole, readable steps (no manifest without its pieces, no half-written "
                                      "folder behind the newest step)")
    bytes: dict[Literal["in_place", "live", "peer", "s3"], int | str] = Field(
        default={}, description="bytes restored per tier (in_place: read by a survivor from its own memory, "
        "nothing moved; live: from other survivors' memory or their node's keeper): an exact count, 0, or '>0'")

    @field_validator("failed_uploads")
    @classmethod
    def _count_or_positive(cls, v):
        if isinstance(v, str) and v.strip() != ">0":
            raise ValueError(f"{v!r}: use a count or '>0'")
        return v

    @field_validator("bytes")
    @classmethod
    def _bytes(cls, v: dict):
        for tier, want in v.items():
            if isinstance(want, str) and want.strip() != ">0":
                raise ValueError(f"{tier}: {want!r}: use a count of bytes or '>0'")
        return v


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    name: str
    description: str = ""
    job: JobSpec
    faults: list[Fault]
    expect: Expect = Expect()
    plan: Plan | None = Field(default=None, description="the job's first plan (default: the planner's), e.g. a "
                              "pipeline whose stages' nodes hold every copy of some units; its nodes are the job's")
    slow: bool = Field(default=False, description="left out of `make test` (tests/test_drills.py)")

    def added_nodes(self) -> set[str]:
        """Nodes that start absent: an add-node fault brings them in."""
        return {n for f in self.faults if f.kind == "add-node" for n in f.nodes}

    def notice_cloud(self) -> str:
        clouds = {f.cloud for f in self.faults if f.kind == "notice" and f.cloud != "ray"}
        return clouds.pop() if clouds else "none"


class _LineLoader(yaml.SafeLoader):
    """Safe YAML that records each mapping's first line under the key `__line__`."""


def _mapping_with_line(loader, node):
    m = loader.construct_mapping(node, deep=True)
    m["__line__"] = node.start_mark.line + 1
    return m


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_with_line)


def _strip_lines(x):
    if isinstance(x, dict):
        return {k: _strip_lines(v) for k, v in x.items() if k != "__line__"}
    if isinstance(x, list):
        return [_strip_lines(v) for v in x]
    return x


def scenario_files(folder: str | Path) -> list[Path]:
    """The scenarios of a drills folder, by name: its YAML files but the jobs they name (`job-*.yaml`)."""
    return sorted(p for p in Path(folder).glob("*.yaml") if not p.name.startswith("job-"))


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    if p.is_dir() or not p.is_file():
        raise ConfigError(f"scenario {str(p)!r} {'is a directory' if p.is_dir() else 'does not exist'}; pass a "
                          "drill file (see drills/)")
    data = _read_yaml(p, "scenario", _LineLoader)
    return parse_scenario(data, str(p), p.parent)


def parse_scenario(data: object, source: str = "<scenario>", base: Path | None = None) -> Scenario:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a scenario is a YAML mapping with name:, job: and faults: (see drills/)")
    line = data.get("__line__", 1)
    for key in ("name", "job", "faults"):
        if key not in data:
            raise ConfigError(f"{source}: line {line}: '{key}:' is missing; add it (see drills/)")
    job = _job(data["job"], source, base)
    if "checkpoint" in data:  # the scenario's S3 settings over the job's (a shared job file, per-scenario tiers)
        merged = (job.checkpoint.model_dump(exclude_unset=True) if job.checkpoint else {}) | \
            _strip_lines(data["checkpoint"] or {})
        merged.setdefault("uri", f"s3://hetspot-drill/{data['name']}")
        job = parse_job(job.model_dump(exclude_unset=True) | {"checkpoint": merged}, f"{source}: checkpoint")
    if "steps" in data:  # the scenario's length over the job's (a shared job file, a longer run)
        steps = data["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"{source}: steps: {steps!r} is not a positive whole number of steps; use e.g. steps: 10")
        job = job.model_copy(update={"steps": steps})
    faults_raw = data["faults"]
    if not isinstance(faults_raw, list) or not faults_raw:
        raise ConfigError(f"{source}: 'faults:' must be a non-empty list of faults, each with kind: and at_step: "
                          "or at_s:")
    faults = [_fault(f, i, source) for i, f in enumerate(faults_raw)]
    rest = {k: _strip_lines(v) for k, v in data.items()
            if k not in ("job", "faults", "checkpoint", "steps", "__line__")}
    try:
        sc = Scenario(job=job, faults=faults, **rest)
    except ValidationError as e:
        raise ConfigError(format_validation(source, e, "scenario")) from None
    check_against_job(sc, source)
    return sc


def _job(raw: object, source: str, base: Path | None) -> JobSpec:
    if isinstance(raw, str):
        from orchestrator.job_spec import load_job

        return load_job((base or Path(".")) / raw)
    raw = _strip_lines(raw)
    if isinstance(raw, dict) and isinstance(raw.get("cluster"), str) and base is not None:
        raw = raw | {"cluster": _cluster_file(base / "scenario", raw["cluster"])}
    return parse_job(raw, f"{source}: job")


def _fault(raw: object, i: int, source: str) -> Fault:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: faults[{i}]: each fault is a mapping such as {{kind: preempt, at_step: 3, "
                          "nodes: [NAME]}")
    line = raw.get("__line__", 0)
    where = f"{source}: line {line} (faults[{i}])"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{where}: unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
    if (raw.get("at_step") is None) == (raw.get("at_s") is None):
        raise ConfigError(f"{where}: give exactly one of at_step: (a step number) or at_s: (seconds after the start)")
    try:
        f = Fault.model_validate(_strip_lines(raw) | {"line": line})
    except ValidationError as e:
        raise ConfigError(format_validation(where, e, "fault")) from None
    if kind in NEEDS_NODES and not f.nodes:
        raise ConfigError(f"{where}: a {kind} fault needs nodes: [NAME, ...] (names from the job's cluster)")
    return f


def check_against_job(sc: Scenario, source: str) -> None:
    """Faults name nodes of the job's cluster and steps inside the job; one notice cloud per scenario."""
    if sc.job.cluster is None:
        raise ConfigError(f"{source}: the job has no cluster: section; a drill runs on the job's test cluster")
    names = [n.name for n in sc.job.cluster.nodes]
    added = sc.added_nodes()
    if not set(names) - added:
        raise ConfigError(f"{source}: every node is added by an add-node fault; at least one must be there at the "
                          "start")
    for i, f in enumerate(sc.faults):
        where = f"{source}: line {f.line} (faults[{i}])"
        for n in f.nodes + f.then:
            if n not in names:
                raise ConfigError(f"{where}: node {n!r} is not in the job's cluster ({', '.join(names)}); fix the name "
                                  "or add the node to job.cluster.nodes")
        if f.at_step is not None and f.at_step >= sc.job.steps:
            raise ConfigError(f"{where}: at_step {f.at_step} is past the job's last step ({sc.job.steps - 1}); use a "
                              f"step below {sc.job.steps} or raise job.steps")
        early = [n for n in f.nodes if f.kind != "add-node" and n in added and _before(f, _adder(sc, n))]
        if early:
            raise ConfigError(f"{where}: node(s) {early} join later by an add-node fault; a fault before they join "
                              "cannot take them; move the fault after the add-node one")
    if sc.plan is not None:
        stray = sorted(set(sc.plan.nodes()) - set(names))
        if stray:
            raise ConfigError(f"{source}: plan: node(s) {stray} are not in the job's cluster ({', '.join(names)}); "
                              "place the plan's stages on the job's nodes")
    clouds = {f.cloud for f in sc.faults if f.kind == "notice" and f.cloud != "ray"}
    if len(clouds) > 1:
        raise ConfigError(f"{source}: notices from {sorted(clouds)}: a job polls one cloud's metadata service; "
                          "split the scenario (Ray drains may go with any)")


def _adder(sc: Scenario, node: str) -> Fault:
    return next(f for f in sc.faults if f.kind == "add-node" and node in f.nodes)


def _before(f: Fault, add: Fault) -> bool:
    if f.at_step is not None and add.at_step is not None:
        return f.at_step < add.at_step
    if f.at_s is not None and add.at_s is not None:
        return f.at_s < add.at_s
    return False  # one at a step, one at a time: their order is known only when the drill runs


def check_expect(expect: Expect, got: dict) -> list[str]:
    """What the run showed against what the scenario implies; the mismatches, as sentences."""
    bad = []
    for key in ("lost_steps", "replans", "drains", "restores", "refused_steps", "scale_ups", "warmed"):
        want = getattr(expect, key)
        if want is not None and got[key] != want:
            bad.append(f"{key}: expected {want}, got {got[key]}")
    if expect.final_nodes is not None and sorted(expect.final_nodes) != got["final_nodes"]:
        bad.append(f"final plan's nodes: expected {sorted(expect.final_nodes)}, got {got['final_nodes']}")
    if expect.failed_uploads is not None and not _matches(expect.failed_uploads, got["failed_uploads"]):
        bad.append(f"failed_uploads: expected {expect.failed_uploads}, got {got['failed_uploads']}")
    if expect.s3_last_step is not None and got["s3_last_step"] != expect.s3_last_step:
        bad.append(f"the job's last step in S3: expected {expect.s3_last_step}, got {got['s3_last_step']}")
    if expect.s3_good_only and got.get("s3_not_good"):
        bad.append(f"the job's prefix holds steps that are not whole and readable: {'; '.join(got['s3_not_good'])}")
    for tier, want in expect.bytes.items():
        if not _matches(want, got["bytes_by_tier"][tier]):
            bad.append(f"bytes from {tier}: expected {want}, got {got['bytes_by_tier'][tier]}")
    return bad


def _matches(want: int | str, got: int) -> bool:
    return got > 0 if isinstance(want, str) else got == want
