"""bench/control_plane.py at its smallest (64 GPUs, one kill): the controller's recovery path over the in-process
stand-ins runs end to end (the bench itself asserts the restore brought back the committed step), survivors are
kept in place, and the table has a row per size."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_one_node_loss_at_the_smallest_size_recovers_in_place():
    r = subprocess.run([sys.executable, str(ROOT / "bench/control_plane.py"), "--sizes", "64", "128", "--trials", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split(" | ") for line in r.stdout.splitlines()
            if line.startswith("| ") and ("(64)" in line or "(128)" in line)]
    assert len(rows) == 2, r.stdout
    for row in rows:
        ranks_after, kept = (int(x.replace(",", "")) for x in row[1:3])
        assert 0 < kept <= ranks_after, row  # the survivors' processes were taken by the new plan's ranks
    assert "growth 64 -> 128 GPUs" in r.stdout
