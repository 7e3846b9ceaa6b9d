"""The migration-aware scale-up policy: pure, plain numbers in, a decision and its reason out."""

import pytest

from orchestrator.policies import Candidate, migration_cost_s, scale_policy

pytestmark = pytest.mark.unit
BW = {"live": 10e9, "peer": 1e9, "s3": 0.1e9}
NOW = Candidate("running", 1000.0, {}, 0.0)


def test_faster_plan_is_taken_when_the_gain_pays_for_the_move():
    fast = Candidate("with-h100", 3000.0, {"peer": 2e9}, 5.0)  # 5 s start-up + 2 s of transfers
    d = scale_policy(NOW, [fast], tokens_left=1e6, bandwidth=BW)
    assert d.move and d.chosen == "with-h100"
    assert d.finish_s["running"] == pytest.approx(1000.0) and d.finish_s["with-h100"] == pytest.approx(7 + 1e6 / 3000)


def test_faster_plan_is_declined_near_the_end_with_the_numbers():
    fast = Candidate("with-h100", 3000.0, {"peer": 2e9}, 5.0)
    d = scale_policy(NOW, [fast], tokens_left=6000.0, bandwidth=BW)  # 6 s left; gain 4 s < cost 7 s
    assert not d.move and d.chosen == "running"
    assert "gain 4.0 s" in d.reason and "migration cost 7.0 s" in d.reason


def test_among_candidates_the_soonest_finish_wins_not_the_fastest():
    fastest = Candidate("everything", 4000.0, {"s3": 10e9}, 5.0)  # 100 s of S3 reads
    local = Candidate("same-nodes", 3000.0, {"live": 1e9}, 5.0)
    d = scale_policy(NOW, [fastest, local], tokens_left=1e6, bandwidth=BW)
    assert d.chosen == "same-nodes"
    assert migration_cost_s(fastest, BW) == pytest.approx(105.0)


def test_no_faster_candidate_stays():
    d = scale_policy(NOW, [Candidate("slower", 500.0, {}, 1.0)], tokens_left=1e6, bandwidth=BW)
    assert not d.move and "no candidate plan is faster" in d.reason
