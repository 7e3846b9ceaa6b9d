"""Shared fixtures. Ray tests share one embedded test cluster per module (see tests/test_train_ray.py)."""

import functools
import os
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

# typer sets PYDANTIC_DISABLE_PLUGINS while it parses a command line and deletes it after (when it was unset): a thread
# that reads the whole environment meanwhile (botocore's proxy lookup, on each new client) fails with KeyError. A user's
# `hetspot` parses before it starts a thread; tests run the CLI in-process (CliRunner) beside their own threads (a
# killer thread, S3 pollers), so the variable is set here, empty, which disables no pydantic plugin, and typer then
# only rewrites it. tests/test_cli_plan.py shows the variable deleted during a parse without this, and none with it.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "")

# A run's writer lock in S3 (orchestrator/state/s3_store.py WriterLock) lapses this long after its controller dies;
# tests that kill a controller and resume would otherwise wait the production minute for it.
os.environ.setdefault("HETSPOT_WRITER_TTL_S", "5")

# hypothesis keeps its files (example database, constants) outside the checkout, not in a `.hypothesis/` folder
# of the user's clone.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), f"hetspot-hypothesis-{os.getuid()}"))


MARKERS = {"unit", "sweep", "ray", "gpu", "slow"}

# Seconds each of the longest modules took in `make test`'s first part on 2 cores (its `--durations` figures, setup and
# teardown included, summed by module; 2026-12). `make
# test` runs the suite on two xdist workers (`--dist loadfile`, with the scheduler below): every module with Ray
# tests is in one scope, so one worker runs them one after another (two embedded test clusters side by side on 2
# cores each ran over twice as slow, and a node's raylet has 30 s to register), while the other worker first runs the
# modules whose heads are their own (`own_head`: `ray start` heads and the autoscaler's, which spend most of their
# time waiting for nodes and jobs), then the pure modules, a module at a time, longest first. The figures only
# order; a stale one costs time, never a result.
MODULE_SECONDS: dict[str, float] = {
    "test_drills.py": 508, "test_recovery_ray.py": 508, "test_train_ray.py": 419, "test_readme.py": 183,
    "test_resume_and_lost_controller.py": 173, "test_data_s3.py": 51, "test_run_record.py": 30,
    "test_fleet_autoscaler.py": 526, "test_real_head.py": 322,
    "test_fleet_choice.py": 173, "test_planner_optimality.py": 153, "test_host_memory.py": 112,
    "test_planner_invariants.py": 102, "test_s3_hostile.py": 88, "test_bad_job_files.py": 53,
    "test_drill_files.py": 48, "test_types.py": 32, "test_cli_plan.py": 31, "test_mixed_precision.py": 30,
    "test_engine_ranks.py": 20,
}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@functools.cache
def _uses_ray(module: str) -> bool:
    """Whether a test module (a path from the rootdir) has Ray tests: its tests all go to the Ray group."""
    return "mark.ray" in (Path(__file__).resolve().parent.parent / module).read_text()


@functools.cache
def _own_head(module: str) -> bool:
    """Whether a test module starts Ray heads of its own (`own_head`: free ports, stops only its processes)."""
    return "mark.own_head" in (Path(__file__).resolve().parent.parent / module).read_text()


def _lane(module: str) -> int:
    """0: the embedded clusters' modules, one after another; 1: the modules with heads of their own, which run in
    the other worker beside them, before the pure modules (2) take that worker (niced)."""
    return 1 if _own_head(module) else 0 if _uses_ray(module) else 2


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # without pytest-xdist the suite runs in one process
    pass
else:
    class _RayModulesTogether(LoadScopeScheduling):
        """A module at a time to a worker, as `--dist loadfile`, but every module with Ray tests in one scope:
        one worker runs those in turn. (`--dist loadgroup` with xdist_group marks would say the same, but
        pytest-xdist 3.8 sets a node id attribute pytest 9 no longer reads, so its groups are lost.)"""

        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return ("ray", "own-head", module)[_lane(module)]

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadfile":
            return _RayModulesTogether(config, log)
        return None


@functools.cache
def _yield_to_ray() -> None:
    """Lower this process's CPU priority (once; it cannot be raised back)."""
    os.nice(10)


def pytest_runtest_setup(item):
    """Under `make test`'s two xdist workers, the worker running pure modules yields the CPU to the one running the
    Ray modules: those are the longer path and are the ones with deadlines (health checks, a raylet's 30 s to
    register, drain deadlines), while a pure test only waits longer. The Ray scope is scheduled first, so a
    worker that runs a pure module never takes a Ray one after it."""
    if os.environ.get("PYTEST_XDIST_WORKER") and not _uses_ray(_module(item.nodeid)):
        _yield_to_ray()


def pytest_collection_modifyitems(items):
    """Every test says what it needs (pyproject's markers): a test without one is a collection error. Then the
    order: the modules with embedded clusters first, then those with heads of their own, then the pure modules,
    the longest first (MODULE_SECONDS); each module's tests in their own order."""
    bare = [it.nodeid for it in items if not {m.name for m in it.iter_markers()} & MARKERS]
    if bare:
        raise RuntimeError(f"tests without a marker ({', '.join(sorted(MARKERS))}): " + ", ".join(bare[:10]))
    first = {}
    for i, it in enumerate(items):
        first.setdefault(_module(it.nodeid), i)
    items.sort(key=lambda it: (_lane(_module(it.nodeid)),
                              -MODULE_SECONDS.get(_module(it.nodeid).rsplit("/", 1)[-1], 0.0),
                              first[_module(it.nodeid)]))  # stable: a module's tests keep their order
