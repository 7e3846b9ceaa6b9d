"""Regenerate docs/benchmarks.md's tables: run each benchmark and write what it prints between its markers.

    python bench/report.py                 # every CPU block (about 35 minutes on a 2-core machine)
    python bench/report.py --only planner-quality simulate-goodput
    python bench/report.py --list          # the blocks, their commands and sections
    python bench/report.py --gpu RUN.json  # the GPU block, from `make gpu-check`'s JSON (no GPU needed here)

The page is prose written by hand around generated blocks. A block is

    <!-- generated: ID | python bench/SCRIPT.py ARGS -->
    _Measured DATE, commit SHA, MACHINE._
    (the command's standard output)
    <!-- end: ID -->

and this script owns everything between the two markers: it runs the command from the repository root, takes its
standard output (the benchmarks print progress on standard error), and writes it back with the date, the commit
and the machine it ran on. A block that fails keeps its old text and is named at the end (exit 1).
tests/test_benchmarks_page.py checks that every table in the page sits in such a block, that each block's command
is the one listed here, and that its script exists.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
GPU_JSON = "docs/gpu-run.json"
CODE = ("planner/", "workers/", "orchestrator/", "bench/", "examples/", "drills/", "pyproject.toml", "constraints.txt")


@dataclass(frozen=True)
class Block:
    id: str
    command: str  # run from the repository root with this interpreter: "python bench/X.py ARGS"
    timeout_s: int = 900
    gpu: bool = False  # written from a GPU run's JSON, not run by the CPU report

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.command)
        assert words[0] == "python", self.command
        return [sys.executable, *words[1:]]


# In the page's order, at sizes for a 2-core machine: about 35 minutes in all, 11 of them bench/peers.py (Ray Train
# restarts its worker group after a kill, 20-70 s each, for each of its two set-ups).
BLOCKS = [
    Block("planner-speedup", "python bench/planner.py --quick --no-warm"),
    Block("planner-optimality", "python bench/optimality.py --clusters 40 --seed 1"),
    Block("planner-scale", "python bench/planner.py --warm-only"),
    Block("planner-time", "python bench/plan_time.py --runs 3"),
    Block("cost-calibration", "python bench/calibration.py"),
    Block("replan-movement", "python bench/replan_movement.py"),
    Block("train-throughput", "python bench/train.py --steps 8 --warmup 2"),
    Block("recovery", "python bench/recovery.py --trials 3 --reshard-trials 1 --join-trials 1"),
    Block("recovery-peers", "python bench/peers.py --kills 2"),
    Block("drills", "python bench/drills.py"),
    Block("survivor-memory", "python bench/survivor_memory.py --recoveries 20"),
    Block("keeper-start", "python bench/keeper_start.py --trials 3"),
    Block("s3-restore", "python bench/s3_restore.py --repeats 3"),
    Block("control-plane", "python bench/control_plane.py --sizes 1024 4096 --trials 3"),
    Block("simulate-goodput", "python bench/simulate.py"),
    Block("simulate-sensitivity", "python bench/simulate.py --sensitivity"),
    Block("simulate-jobs", "python bench/simulate.py --jobs"),
    Block("data-s3", "python bench/data_s3.py --trials 3 --steps 8"),
    Block("data-prepare", "python bench/data_prepare.py --repeats 3"),
    Block("status", "python bench/status.py --repeats 3"),
    Block("offload-cpu", "python bench/offload.py --params 20e6 --repeats 3"),
    Block("gpu", f"python bench/gpu_check.py --tables-from {GPU_JSON}", gpu=True),
]
BY_ID = {b.id: b for b in BLOCKS}
START = re.compile(r"<!-- generated: (?P<id>[a-z0-9-]+) \| (?P<command>.+?) -->")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def machine() -> str:
    """The machine in words: cores, memory, load, device, versions."""
    mem = ""
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal"))
                 .split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip() if _which("nvidia-smi") else ""
    versions = [f"Python {platform.python_version()}"]
    for mod in ("torch", "ray"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} cores{mem}, load {load:.1f} at the start, "
            f"{gpu.splitlines()[0] if gpu else 'no GPU'}, {', '.join(versions)}")


def _which(cmd: str) -> bool:
    return any((Path(p) / cmd).is_file() for p in os.environ.get("PATH", "").split(os.pathsep))


def stamp() -> str:
    changed = [ln[3:] for ln in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    dirty = "+local changes" if any(p.startswith(CODE) for p in changed) else ""  # in what the benchmarks run
    return (f"_Measured {datetime.date.today().isoformat()}, commit {_git('rev-parse', '--short', 'HEAD')}{dirty}, "
            f"{machine()}; `{{command}}` took {{took:.0f}} s._")


def blocks_in(text: str) -> list[tuple[str, str]]:
    """(id, command) of every generated block in `text`, in order."""
    return [(m["id"], m["command"]) for m in START.finditer(text)]


def replace_block(text: str, block: Block, body: str) -> str:
    """`text` with `block`'s generated part replaced by `body`; ValueError if the page has no such block."""
    pat = re.compile(rf"(<!-- generated: {re.escape(block.id)} \| [^\n]*-->\n)(.*?)(<!-- end: "
                     rf"{re.escape(block.id)} -->)", re.S)
    if not pat.search(text):
        raise ValueError(f"{PAGE.name} has no block {block.id!r} (a `<!-- generated: {block.id} | ... -->` line "
                         f"and `<!-- end: {block.id} -->`)")
    head = f"<!-- generated: {block.id} | {block.command} -->\n"
    return pat.sub(lambda m: head + body.rstrip() + "\n" + m[3], text, count=1)


def run(block: Block) -> str:
    t0 = time.perf_counter()
    out = subprocess.run(block.argv, cwd=ROOT, capture_output=True, text=True, timeout=block.timeout_s)
    if out.returncode:
        raise RuntimeError(f"exit {out.returncode}: {out.stderr.strip()[-800:]}")
    took = time.perf_counter() - t0
    if block.gpu:  # the run's own device, date and commit head its output
        return f"_Rendered by `{block.command}` from the GPU run's JSON._\n\n" + _nested(out.stdout) + "\n"
    return stamp().format(command=block.command, took=took) + "\n\n" + _nested(out.stdout) + "\n"


def _nested(stdout: str) -> str:
    """A benchmark's output under its section: its own headings one level below the page's (####)."""
    return "\n".join(re.sub(r"^#{1,6} ", "#### ", ln) for ln in stdout.strip().splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", metavar="ID", help="these blocks only")
    ap.add_argument("--list", action="store_true", help="the blocks and their commands")
    ap.add_argument("--gpu", metavar="RUN.json", help="write the GPU block from this `make gpu-check` JSON")
    args = ap.parse_args()
    if args.list:
        for b in BLOCKS:
            print(f"{b.id:22} {b.command}{'  (from a GPU run)' if b.gpu else ''}")
        return
    if unknown := set(args.only or ()) - set(BY_ID):
        print(f"error: --only: no block {', '.join(sorted(unknown))}; `--list` names them", file=sys.stderr)
        raise SystemExit(2)
    if args.gpu:
        src = Path(args.gpu)
        if not src.is_file():
            print(f"error: --gpu {args.gpu}: no such file (`make gpu-check` writes {GPU_JSON})", file=sys.stderr)
            raise SystemExit(2)
        if src.resolve() != (ROOT / GPU_JSON).resolve():
            (ROOT / GPU_JSON).write_text(src.read_text())
        todo = [BY_ID["gpu"]]
    else:
        todo = [b for b in BLOCKS if not b.gpu and (not args.only or b.id in args.only)]
    failed = []
    for i, b in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {b.id}: {b.command}", file=sys.stderr, flush=True)
        try:
            body = run(b)
            PAGE.write_text(replace_block(PAGE.read_text(), b, body))  # each block as it ends: a cut run keeps it
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            print(f"  failed, its old text kept: {exc}", file=sys.stderr, flush=True)
            failed.append(b.id)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
