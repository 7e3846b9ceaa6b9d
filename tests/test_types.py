"""The state plane type-checks: mypy over what pyproject.toml's [tool.mypy] names (orchestrator/state/ and
workers/transfer.py, the records every state-plane call carries), so the protocols in state/protocols.py and the
records' annotations are checked against the code, not only read (tests/test_transfer_types.py checks that the
calls are annotated with records at all)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_the_state_plane_type_checks():
    from mypy import api

    assert 'files = ["orchestrator/state", "workers/transfer.py"]' in (ROOT / "pyproject.toml").read_text()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the config's paths are the repository's
    try:
        out, err, code = api.run(["--config-file", "pyproject.toml", "--cache-dir", os.devnull])
    finally:
        os.chdir(cwd)
    assert code == 0, out + err
