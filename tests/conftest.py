"""Shared fixtures. Ray tests share one embedded test cluster per module (see tests/test_train_ray.py)."""

import os

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
