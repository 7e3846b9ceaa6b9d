"""Shared fixtures. Ray tests share one embedded test cluster per module (see tests/test_train_ray.py)."""

import os
import tempfile

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

# hypothesis keeps its files (example database, constants) outside the checkout, not in a `.hypothesis/` folder
# of the user's clone.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), f"hetspot-hypothesis-{os.getuid()}"))


MARKERS = {"unit", "sweep", "ray", "gpu", "slow"}

# Seconds each of the longest modules took in a serial `make test` (2 cores, 2026-11-28): `make test` runs the
# suite on two xdist workers a module at a time, and hands the longest modules out first so that neither worker
# is left with a long one at the end (longest-processing-time-first). A module not listed goes after these, in
# file order; the figures only order, a stale one costs time, never a result.
MODULE_SECONDS: dict[str, float] = {
    "test_recovery_ray.py": 1028, "test_train_ray.py": 618, "test_drills.py": 554, "test_planner_invariants.py": 346,
    "test_planner_optimality.py": 237, "test_resume_and_lost_controller.py": 231, "test_readme.py": 165,
    "test_host_memory.py": 146, "test_fleet_choice.py": 125, "test_s3_hostile.py": 121,
}


def pytest_collection_modifyitems(items):
    """Every test says what it needs (pyproject's markers): a test without one is a collection error. Then the
    longest modules first (MODULE_SECONDS), each module's tests in their own order."""
    bare = [it.nodeid for it in items if not {m.name for m in it.iter_markers()} & MARKERS]
    if bare:
        raise RuntimeError(f"tests without a marker ({', '.join(sorted(MARKERS))}): " + ", ".join(bare[:10]))
    first = {}
    for i, it in enumerate(items):
        first.setdefault(it.nodeid.split("::", 1)[0], i)

    def key(it):
        module = it.nodeid.split("::", 1)[0]
        return -MODULE_SECONDS.get(module.rsplit("/", 1)[-1], 0.0), first[module]

    items.sort(key=key)  # stable: a module's tests keep their order
