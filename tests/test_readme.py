"""The README's commands, run in the README's order from a fresh copy of the repository (its tracked files
only), each exiting 0: every `hetspot` command of its ```bash blocks that needs no cloud. A block that names a
running cluster through HETSPOT_ADDRESS is left out, and so is a line that names one (HEAD, --address, a
job id) or a cloud bucket, or has a placeholder (JOB.yaml); `make` targets are what CI runs anyway. The
spot-trace replay takes minutes, so it runs with the `slow` tests."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HETSPOT = str(Path(sys.executable).with_name("hetspot"))
CLOUD = ("HEAD", "--address", "BUCKET", "hetspot-tiny-cluster-", "--ec2-region")  # a running cluster or a cloud
PLACEHOLDERS = ("JOB.yaml",)


def readme_commands() -> list[str]:
    """The README's runnable `hetspot` commands, in order, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        if "HETSPOT_ADDRESS=" in block:  # every command after it talks to that cluster
            continue
        for line in block.splitlines():
            cmd = line.split("  #")[0].strip()
            if cmd.startswith("hetspot ") and not any(p in cmd for p in CLOUD + PLACEHOLDERS):
                out.append(cmd)
    return out


def fresh_copy(dest: Path) -> Path:
    """The repository's tracked files (and the shipped traces), as a clone has them."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for f in files:
        if not (ROOT / f).is_file():  # deleted in the working tree
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return dest


def run_in_order(tmp_path: Path, keep) -> list[str]:
    clone = fresh_copy(tmp_path / "hetspot")
    ran = []
    for cmd in readme_commands():
        if not keep(cmd):
            continue
        if "hetspot-runs/" in cmd:  # the run folder `submit` printed, timestamped
            runs = sorted((clone / "hetspot-runs").glob("tiny-mixed-*"))
            assert runs, f"{cmd}: no run record from the submit before it"
            cmd = re.sub(r"hetspot-runs/\S+", f"hetspot-runs/{runs[-1].name}", cmd)
        args = cmd.split()[1:]
        r = subprocess.run([HETSPOT, *args], cwd=clone, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (f"README command `{cmd}` exited {r.returncode}:\n{r.stdout[-2000:]}\n"
                                   f"{r.stderr[-3000:]}")
        ran.append(cmd)
    return ran


@pytest.mark.unit
def test_the_readme_names_the_commands_this_test_runs():
    cmds = readme_commands()
    assert cmds[0] == "hetspot --version"
    for want in ("hetspot plan examples/mixed-cluster.yaml", "hetspot submit examples/tiny-mixed.yaml",
                 "hetspot drill drills/preempt.yaml --plot drill.png"):
        assert want in cmds, cmds
    assert any(c.startswith("hetspot drill --trace examples/traces/") for c in cmds)


@pytest.mark.ray
def test_the_readme_commands_exit_0_from_a_fresh_copy(tmp_path):
    ran = run_in_order(tmp_path, lambda cmd: "--trace" not in cmd or cmd.startswith("hetspot simulate"))
    for first in ("hetspot plan ", "hetspot submit ", "hetspot plot ", "hetspot drill drills/", "hetspot simulate "):
        assert any(c.startswith(first) for c in ran), (first, ran)


@pytest.mark.slow
def test_the_readme_trace_replay_exits_0_from_a_fresh_copy(tmp_path):
    ran = run_in_order(tmp_path, lambda cmd: cmd.startswith("hetspot drill --trace"))
    assert ran
