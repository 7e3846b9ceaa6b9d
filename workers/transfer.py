"""What crosses the state plane's process boundaries, as both sides see it (the workers, and orchestrator/state/
and runtime/, which may import workers/ but not the reverse). For now: how many bytes a value carries across one
(`payload_bytes`), which the controller side counts to show it takes in metadata only."""

from __future__ import annotations


def payload_bytes(obj) -> int:
    """Bytes of a value as it crosses a process boundary: tensors by their data, containers by their parts."""
    import numpy as np
    import torch

    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(x) for x in obj)
    if hasattr(obj, "__dict__"):
        return payload_bytes(vars(obj))
    return 8
