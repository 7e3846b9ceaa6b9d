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


def pytest_collection_modifyitems(items):
    """Every test says what it needs (pyproject's markers): a test without one is a collection error."""
    bare = [it.nodeid for it in items if not {m.name for m in it.iter_markers()} & MARKERS]
    if bare:
        raise RuntimeError(f"tests without a marker ({', '.join(sorted(MARKERS))}): " + ", ".join(bare[:10]))
