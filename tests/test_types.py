"""The recovery wing and the planner type-check and the code lints: mypy over what pyproject.toml's [tool.mypy] names
(orchestrator/control/, orchestrator/state/, orchestrator/runtime/ and workers/, the records every state-plane call
carries among them, and planner/), so the protocols in control/protocols.py and state/protocols.py and the records'
annotations are checked against the code, not only read (tests/test_transfer_types.py checks that the calls are
annotated with records at all); and ruff over the code, the line-length rule on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_the_recovery_wing_type_checks():
    from mypy import api

    assert 'files = ["orchestrator/control", "orchestrator/state", "orchestrator/runtime", "workers", "planner"]' in (
        ROOT / "pyproject.toml").read_text()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the config's paths are the repository's
    try:
        out, err, code = api.run(["--config-file", "pyproject.toml", "--cache-dir", os.devnull])
    finally:
        os.chdir(cwd)
    assert code == 0, out + err


def test_the_code_lints_at_the_line_length_it_is_written_to():
    """`make lint`, run by CI's `make test`: ruff's rules in pyproject.toml, the line-length rule (E501) on at 120."""
    import subprocess
    import sys

    cfg = (ROOT / "pyproject.toml").read_text()
    assert "line-length = 120" in cfg and '"E501"' not in cfg  # the rule is on
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff), "check", "planner", "workers", "orchestrator", "tests", "bench"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
