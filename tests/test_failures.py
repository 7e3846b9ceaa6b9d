"""Failure kinds from what a worker raised (orchestrator/control/failure.py): a peer gone under a collective
is transient (re-plan), whatever words gloo uses for it; an error every plan would hit again is not."""

import pytest

from orchestrator.control.failure import FailureKind, classify_error, is_transient

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("exc_type, message", [
    # gloo's words for a peer that went, as these tests' runs have seen them
    ("RuntimeError", "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:21390"),
    ("RuntimeError", "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:20116: Connection reset by peer"),
    ("RuntimeError", "Application timeout caused pair closure"),  # a collective that ran past its timeout
    ("RuntimeError", "Timed out waiting 3000ms for recv operation to complete"),
    ("DistBackendError", "NCCL communicator was aborted"),
])
def test_a_peer_gone_under_a_collective_is_a_collective_error_and_transient(exc_type, message):
    kind = classify_error(exc_type, message)
    assert kind == FailureKind.COLLECTIVE and is_transient(kind.value)


@pytest.mark.parametrize("exc_type, message", [
    ("RuntimeError", "mat1 and mat2 shapes cannot be multiplied (8x32 and 64x32)"),
    ("DataError", "data.path 'x.bin': token id 9 at token 12 is not below model.vocab_size=8"),
])
def test_an_error_any_plan_would_hit_again_is_deterministic(exc_type, message):
    kind = classify_error(exc_type, message)
    assert kind == FailureKind.DETERMINISTIC and not is_transient(kind.value)


def test_a_dead_actor_is_transient():
    assert classify_error("ActorDiedError", "The actor died unexpectedly") == FailureKind.ACTOR_DIED
