"""One node's keeper (orchestrator/state/keeper.py), as a plain object without a Ray cluster: what it keeps
and for how long, the regions it cuts for a restore (weights now, moments deferred), its S3 uploads, a
corrupt S3 piece refused, and its own write check. S3 is moto's server reached by boto3."""


import numpy as np
import pytest

from orchestrator.state.keeper import KeeperStore
from orchestrator.state.s3_store import S3Checkpoints
from tests.moto_s3 import moto_s3, use_test_credentials
from workers.transfer import CheckpointLocation, HeldRow, Refused, S3Request, ShardRequest, Tier

pytestmark = pytest.mark.unit


def shards(rank: int, step: int) -> dict:
    """A rank's export: unit "w" (4 x 2), rows [2 * rank, 2 * rank + 2) of it, filled with step + rank."""
    a = np.full((2, 2), float(step + rank))
    return {"w": {"param": a, "exp_avg": a + 0.5, "exp_avg_sq": a + 0.25, "slice": ((2 * rank, 2 * rank + 2), (0, 2)),
                  "shape": (4, 2), "optimizer_steps": float(step + 1)}}


@pytest.fixture(scope="module")
def s3():
    use_test_credentials()
    with moto_s3("keep") as url:
        yield url


def test_peer_copies_keep_the_newest_steps_and_pinned_ones_until_unpinned():
    k = KeeperStore("n1", keep_peer_steps=2)
    k.put("peer", 0, 0, shards(0, 0), pin=True)  # an S3 upload of step 0 is coming
    for step in (1, 2, 3):
        k.put("peer", step, 0, shards(0, step))
    assert sorted({r.step for r in k.inventory()}) == [0, 2, 3]
    k.unpin(0)
    assert sorted({r.step for r in k.inventory()}) == [2, 3]
    k.put("live", 3, 1, shards(1, 3))
    assert k.clear("live") == 1 and {r.tier for r in k.inventory()} == {"peer"}


def test_inventory_is_metadata_and_get_many_cuts_the_region_deferring_the_moments():
    k = KeeperStore("n1")
    k.put("peer", 5, 1, shards(1, 5))
    (row,) = k.inventory()
    assert row == HeldRow("w", ((2, 4), (0, 2)), 5, (4, 2), 6.0, Tier.PEER, 1, 96)
    (a,) = k.get_many([ShardRequest(Tier.PEER, 1, "w", ((3, 4), (0, 2)))], 5, keys=("param",))
    assert a.tier == Tier.PEER and a.tensors["param"].tolist() == [[6.0, 6.0]]
    assert a.bytes == 16 and a.deferred == 32  # the two moments of that row come later
    (m,) = k.get_many([ShardRequest(Tier.PEER, 1, "w", ((3, 4), (0, 2)))], 5, keys=("exp_avg", "exp_avg_sq"))
    assert m.tensors["exp_avg"].tolist() == [[6.5, 6.5]] and m.deferred == 16  # the weights, brought before


def test_upload_then_a_restore_reads_s3_pieces_once_and_refuses_a_corrupt_one(s3):
    k = KeeperStore("n1")
    for rank in (0, 1):
        k.put("peer", 7, rank, shards(rank, 7), pin=True)
    at = CheckpointLocation("s3://keep/job", s3)
    entries = k.upload(7, [ShardRequest(Tier.PEER, 0, "w", ((0, 2), (0, 2))),
                           ShardRequest(Tier.PEER, 1, "w", ((2, 4), (0, 2)))], at)
    assert [e.unit for e in entries] == ["w", "w"] and all(e.piece.bytes > 0 for e in entries)
    assert k.inventory() and 7 in k.pinned  # the state plane releases the pin when the whole upload ends
    piece = entries[1].piece
    fresh = KeeperStore("n2")
    (got,) = fresh.get_many([S3Request(piece, ((3, 4), (0, 2)))], 7, s3=at)
    assert got.tier == Tier.S3 and got.tensors["param"].tolist() == [[8.0, 8.0]] and got.bytes == piece.bytes
    store = S3Checkpoints("s3://keep/job", s3)
    store.client.put_object(Bucket="keep", Key=piece.key, Body=b"not the bytes the manifest names")
    (bad,) = KeeperStore("n3").get_many([S3Request(piece, ((2, 4), (0, 2)))], 7, s3=at)
    assert isinstance(bad, Refused) and "its manifest says" in bad.error and bad.refusal == "corrupt"  # its size


def test_the_write_check_answers_with_this_nodes_access(s3):
    assert KeeperStore("n1").check_write(CheckpointLocation("s3://keep/job", s3)) is None
    err = KeeperStore("n1").check_write(CheckpointLocation("s3://no-such-bucket/job", s3))
    assert err is not None and "NoSuchBucket" in err


KEEPER_WITHOUT_TORCH = """
import sys
from tests.test_keeper import shards
from orchestrator.state.keeper import KeeperStore
from workers.transfer import CheckpointLocation, S3Request, ShardRequest, Tier
k, at = KeeperStore("n1"), CheckpointLocation("s3://keep/bare", sys.argv[1])
k.put("peer", 2, 0, shards(0, 2), pin=True)
k.get_many([ShardRequest(Tier.PEER, 0, "w", ((1, 2), (0, 2)))], 2)
(e,) = k.upload(2, [ShardRequest(Tier.PEER, 0, "w", ((0, 2), (1, 2)))], at)
(got,) = KeeperStore("n2").get_many([S3Request(e.piece, ((1, 2), (1, 2)))], 2, s3=at)
assert got.tensors["param"].tolist() == [[2.0]], got
print(e.piece.key, "torch" in sys.modules)
"""


def test_a_keeper_keeps_cuts_uploads_and_reads_s3_without_importing_torch(s3):
    """A keeper runs on every node and holds state in host memory: it never imports torch (bench/keeper_start.py:
    2.5x slower to start with it, and 240 MiB more of that memory). Its S3 pieces are the same safetensors a
    worker's torch reader loads."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", KEEPER_WITHOUT_TORCH, s3], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout.split()
    assert out[1] == "False", "the keeper imported torch"
    store = S3Checkpoints("s3://keep/bare", s3)
    obj = store.client.get_object(Bucket="keep", Key=out[0])["Body"].read()
    from safetensors.torch import load

    tensors = load(obj)
    assert tensors["param"].tolist() == [[2.0], [2.0]] and tensors["exp_avg_sq"].dtype.is_floating_point
