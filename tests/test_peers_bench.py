"""bench/peers.py's smallest configuration: hetspot, Ray Train and torchft on the same kill.

The peers are the `peers` extra (`pip install -e '.[peers]'`); `make test` does not install it, so this
skips with the reason there. Where it runs, every system's committed losses are held to its own
uninterrupted run, and the samples audit must agree with that oracle: a system that drops samples cannot
pass it. hetspot must pass it on every kill, on both recovery paths and across a layout change.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[1]
MISSING = [m for m in ("torchft", "ray.train") if importlib.util.find_spec(m.split(".")[0]) is None
           or (m == "ray.train" and importlib.util.find_spec("pandas") is None)]


@pytest.mark.skipif(bool(MISSING), reason=f"the peers extra is not installed ({', '.join(MISSING)}): "
                    "pip install -e '.[peers]' to run bench/peers.py")
def test_the_smallest_peer_comparison_runs_and_holds_each_system_to_its_oracle(tmp_path):
    out = tmp_path / "peers.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--kills", "1", "--steps", "5",
                        "--kill-after", "2", "--preset", "tiny", "--hetero", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    got = json.loads(out.read_text())
    systems = got["systems"]
    assert set(systems) == {"hetspot (in-place)", "hetspot (restart)", "Ray Train (elastic)",
                            "Ray Train (elastic, start timeout 5 s)", "torchft"}, systems
    for name, s in systems.items():
        assert len(s["first_step_s"]) == 1 and s["first_step_s"][0] > 0, (name, s)
        for oracle, samples in zip(s["oracle"], s["samples"], strict=True):
            if samples is not None and samples[0]:  # samples the uninterrupted run trained are missing
                assert oracle != "equal", (name, s)
            assert oracle == "equal" or "samples lost or repeated" in oracle or "missing" in oracle, (name, oracle)
    for name in ("hetspot (in-place)", "hetspot (restart)"):
        assert systems[name]["oracle"] == ["equal"] and systems[name]["lost"] == [0], systems[name]
    assert [h["oracle"] for h in got["hetero"]] == ["equal"], got["hetero"]
    assert "| torchft |" in r.stdout and "hetspot in place / this" in r.stdout
