"""The state plane's calls carry typed records (workers/transfer.py), not tuples dispatched on their first field,
holder strings or dicts: every call between the state plane, a worker group, the keepers and the workers is walked
through its annotations, on the protocols (state/protocols.py) and on each implementation, Ray's and the fakes'."""

from __future__ import annotations

import inspect
import typing

import pytest

from orchestrator.runtime.worker_group import RayWorkerGroup
from orchestrator.state import protocols
from orchestrator.state.fakes import LocalGroup, LocalProcess
from orchestrator.state.keeper import KeeperStore
from orchestrator.state.tiers import TieredState
from workers import transfer
from workers.actor import TrainWorker

pytestmark = pytest.mark.unit

GROUP_CALLS = ("snapshot", "hand_over", "needs", "load", "settle_restore", "retain", "held", "drop_retained")
SOURCE_CALLS = ("get_many",)
# Parameters that carry the bytes themselves or names, for which no record is defined: a rank's shards
# ({unit: its tensors and slice}) and the tensor names a request asks for.
PAYLOAD = {"shards", "keys"}

IMPLEMENTATIONS = [
    (RayWorkerGroup, GROUP_CALLS), (LocalGroup, GROUP_CALLS),
    (KeeperStore, ("put", "inventory", "get_many", "upload", "check_write", "clear")),
    (TrainWorker.__ray_actor_class__, ("receipt", "hand_over", "retain", "held", "get_many", "needs", "load_state")),
    (LocalProcess, ("get_many", "held")), (TieredState, ("restore",)),
]


def _hints(cls, name: str) -> dict[str, object]:
    fn = getattr(cls, name)
    return typing.get_type_hints(fn, vars(inspect.getmodule(fn)) | vars(transfer))


def _untyped(hint) -> list[str]:
    """The bare dicts and tuples inside a type (a tuple of a record, or `tuple[str, ...]`, is typed)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (dict, tuple) or origin is dict:
        return [str(hint)]
    if origin is tuple:
        return [] if args and all(a is Ellipsis or a is str or hasattr(a, "__dataclass_fields__") for a in args) \
            else [str(hint)]
    return [x for a in args for x in _untyped(a)]


@pytest.mark.parametrize("cls, calls", IMPLEMENTATIONS, ids=lambda x: getattr(x, "__name__", ""))
def test_no_tuple_dict_or_tier_string_crosses_a_call(cls, calls):
    for name in calls:
        for param, hint in _hints(cls, name).items():
            if param in PAYLOAD:
                continue
            assert not _untyped(hint), f"{cls.__name__}.{name}: {param} is {hint}"
            if param == "tier":
                assert hint is transfer.Tier, f"{cls.__name__}.{name}: a tier is a Tier, not {hint}"


@pytest.mark.parametrize("cls", [RayWorkerGroup, LocalGroup])
def test_worker_groups_answer_the_state_plane_with_the_protocols_types(cls):
    for name in GROUP_CALLS:
        want = _hints(protocols.StateGroup, name)
        assert _hints(cls, name).get("return") == want.get("return"), (cls.__name__, name)


@pytest.mark.parametrize("cls", [KeeperStore, TrainWorker.__ray_actor_class__, LocalProcess])
def test_every_source_answers_a_piece_request_the_same_way(cls):
    assert _hints(cls, "get_many") == _hints(protocols.Source, "get_many")


def test_a_piece_request_is_one_of_three_records_and_tiers_equal_their_names():
    assert set(typing.get_args(transfer.PieceRequest)) == {transfer.ShardRequest, transfer.KeptRequest,
                                                           transfer.S3Request}
    assert [str(t) for t in transfer.Tier] == ["in_place", "live", "peer", "s3"]
    piece = transfer.S3Piece.of({"key": "k", "region": [[0, 2], [0, 3]], "bytes": 9, "sha256": "ab",
                                 "tensors": {"param": "F32"}, "optimizer_steps": 2.0})
    assert piece.region == ((0, 2), (0, 3)) and transfer.S3Piece.of(piece.entry()) == piece


def test_payload_bytes_counts_data_by_its_bytes_and_containers_by_their_parts():
    """What the controller counts as received (its `received_bytes`): tensors and arrays by their data, strings by
    their length, every scalar 8 bytes, dicts by keys and values, records by their fields, nested to the bottom."""
    import numpy as np
    import torch

    from workers.transfer import HeldRow, payload_bytes

    row = HeldRow("h.0.w", ((0, 4), (0, 3)), 7, (4, 3), 2.0)  # and its defaults: tier "live", rank, nbytes
    assert payload_bytes(row) == 5 + 4 * 8 + 8 + 2 * 8 + 8 + 4 + 8 + 8
    mixed = {"a": torch.zeros(3, dtype=torch.float32), "bb": np.zeros(2, dtype=np.int64), "c": [None, 1.5, True],
             "rows": [row, row]}
    assert payload_bytes(mixed) == (1 + 12) + (2 + 16) + (1 + 3 * 8) + (4 + 2 * payload_bytes(row))
    # inventory and need rows are counted without walking their fields (thousands per recovery): the walk's count
    from dataclasses import fields

    from workers.transfer import NeedRow, Tier, _parts_bytes

    for r in (row, HeldRow("embed", ((0, 50304), (8, 16), (0, 1)), 12, (50304, 64, 1), 3.0, Tier.PEER, 17, 4096),
              HeldRow("", (), 0, (), 0.0, Tier.S3), NeedRow("h.3.mlp", ((0, 24), (8, 16)), 1 << 40),
              NeedRow("", (), 0)):
        assert payload_bytes(r) == _parts_bytes([getattr(r, f.name) for f in fields(r)], (torch.Tensor, np.ndarray))


def test_payload_bytes_of_a_process_whose_torch_is_half_imported(monkeypatch):
    """Another thread of the controller importing torch leaves it in sys.modules without its attributes for a
    while; a count taken then (a restore's manifests) must not fail on it: no tensor exists before torch.Tensor."""
    import sys
    import types

    import numpy as np

    from workers.transfer import payload_bytes

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))  # what a half-run `import torch` leaves
    assert payload_bytes([]) == 0
    assert payload_bytes({"a": np.zeros(2, dtype=np.int64), "b": [1.5, None]}) == (1 + 16) + (1 + 2 * 8)


def test_a_failed_steps_error_unpickles_in_a_controller_without_importing_torch():
    """A worker's StepError crosses to the controller inside Ray's RayTaskError; unpickling it there (the
    controller reading a failure, or Ray reporting the answer a failure left unread) must not import torch: it did
    when StepError lived in workers/engine.py, a second of a recovery's critical path on this machine."""
    import pickle
    import subprocess
    import sys

    from workers.engine import StepError  # as the engine raises it

    blob = pickle.dumps(StepError("rank 1 (pipeline 1, stage 0, L4 on l4-0) failed at step 3: RuntimeError: x",
                                  "RuntimeError"))
    code = ("import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); "
            "assert e.cause_type == 'RuntimeError' and 'failed at step 3' in str(e); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, check=True)
    assert out.stdout.decode().strip() == "False", out.stderr.decode()
