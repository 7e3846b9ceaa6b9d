"""A drill's result (pure): the oracle, the recovery timeline, the samples check, the JSON form."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.transfer import UploadRecord

REL_TOL = 1e-4  # losses of the drill against the reference run


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
    uploads: list[UploadRecord]
    expect_failures: list[str] = field(default_factory=list)
    error: str | None = None
    upload_lag: dict = field(default_factory=dict)  # runner.upload_summary
    reference_kind: str = "fixed"  # runner.REFERENCES
    final_nodes: list[str] = field(default_factory=list)  # the nodes of the plan the drill ended on
    sample_ranges: dict[int, list] = field(default_factory=dict)  # per committed step: (first sample, count) read
    val_losses: dict[int, float] = field(default_factory=dict)  # after step s (train.eval_every): held-out loss

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
                "reference_kind": self.reference_kind,
                "max_rel_diff": self.max_rel_diff, "faults": self.faults, "recoveries": self.recoveries,
                "events": self.events, "bytes_by_tier": self.bytes_by_tier, "lost_steps": self.lost_steps,
                "samples": self.samples, "goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                "useful_s": round(self.useful_s, 3), "expect_failures": self.expect_failures,
                "failed_uploads": sum(1 for u in self.uploads if u.error), "upload_lag": self.upload_lag,
                "tokens_per_s": [{"t_s": round(t, 3), "step": s, "tokens_per_s": round(self.tokens_per_step / dt, 1)}
                                 for s, t, dt in self.commits if dt > 0]}


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
        if e["kind"] == "drain":  # a pre-staged drain trains on after its notice: its stall is what training lost
            row |= {k: e.get(k) for k in ("met_deadline", "stall_s", "new_workers")}
        out.append(row)
    return out
