"""The one restore-source rule (orchestrator/control/migration.py `layer_sources`): a node's own surviving copy
(live), another survivor's (peer), a lost holder's peer snapshot (peer, redo back to the snapshot), else S3.
The controller's migration costs and the fleet simulator's recovery model both count bytes with it."""

import pytest

from orchestrator.control.migration import layer_sources, node_migration_bytes
from planner import ModelSpec, Pipeline, Plan, Stage, TrainSpec

pytestmark = pytest.mark.unit


def plan(*stages: tuple[int, int, str]) -> Plan:
    return Plan(model_name="m", num_layers=4, global_batch=8, pipelines=[Pipeline(
        num_samples=8, micro_batch_size=1, num_micro_batches=8, stages=[
            Stage(layer_start=a, layer_end=b, gpu_type="L4", node=n, devices=[f"{n}/0"]) for a, b, n in stages])])


OLD = plan((0, 2, "a"), (2, 4, "b"))  # a: embedding, 0, 1; b: 2, 3, head


def tiers(new: Plan, gone=frozenset(), peer_of=None) -> dict[tuple[str, int], tuple[str, str | None]]:
    return {(n, x): (t, r) for n, x, t, r in layer_sources(OLD, new, gone, peer_of)}


def test_nothing_gone_each_layer_comes_from_its_own_node_or_the_one_that_held_it():
    got = tiers(plan((0, 3, "a"), (3, 4, "b")))
    assert got[("a", 0)] == ("live", None) and got[("a", 2)] == ("peer", None) and got[("b", 4)] == ("live", None)


def test_a_lost_holder_falls_back_to_its_peer_snapshot_then_to_s3():
    new = plan((0, 4, "a"))
    assert tiers(new, {"b"}, {"a": "b", "b": "a"})[("a", 3)] == ("peer", "snapshot")  # b's snapshot sits on a
    assert tiers(new, {"b"}, {"a": "c", "b": "c"})[("a", 3)] == ("peer", "snapshot")  # on c, which survived
    assert tiers(new, {"b", "c"}, {"a": "c", "b": "c"})[("a", 3)] == ("s3", "s3")  # both gone
    assert tiers(new, {"b"})[("a", 3)] == ("s3", "s3")  # no snapshots kept


def test_the_controllers_bytes_count_live_and_peer_per_node():
    m, t = ModelSpec(name="m", num_layers=4, hidden_size=32, num_heads=4, vocab_size=64, seq_len=16), \
        TrainSpec(global_batch=8)
    got = node_migration_bytes(OLD, plan((0, 3, "a"), (3, 4, "b")), m, t)
    assert set(got) == {"a", "b"} and got["a"]["peer"] > 0 and got["b"]["peer"] == 0 and got["b"]["live"] > 0
