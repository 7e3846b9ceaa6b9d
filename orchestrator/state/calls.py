"""How the state plane reaches keepers and waits on answers: `RayCalls` on a Ray cluster, `LocalCalls` in one
process (the shipped fake: keepers are plain `KeeperStore` objects, every call is answered at once).

`TieredState` (tiers.py) makes every remote call through one of these, so its logic (snapshots, the uploader,
salvage, restore planning and refusal of a corrupt S3 step) runs in unit tests without a Ray cluster, beside
`LocalGroup` (the worker side of the same calls over numpy shards). The model is torchft's
`CheckpointTransport` with its in-process fakes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, Protocol


class StateCalls(Protocol):
    """How the state plane reaches keepers (Ray: calls.RayCalls; in one process: calls.LocalCalls)."""

    lost: tuple  # exception types meaning a keeper or its node is gone

    def start_keeper(self, node: str, node_id: str) -> Any: ...  # a handle: handle.method.remote(...) -> answer
    def get(self, answers: Any, timeout: float | None = None) -> Any: ...
    def wait(self, answers: list, num_returns: int, timeout: float | None) -> tuple[list, list]: ...
    def alive_nodes(self) -> dict[str, str]: ...  # node name -> its Ray node id


class RayCalls:
    """Keepers are Ray actors pinned to their node; answers are Ray object refs."""

    def __init__(self) -> None:
        import ray

        self._ray = ray
        # A keeper or its node gone; or its node gone before the keeper was placed there (pinned to it, Ray answers
        # ActorUnschedulableError: an idle node the autoscaler removed between listing the nodes and placing one).
        self.lost = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
                     ray.exceptions.ActorUnschedulableError)

    def start_keeper(self, node: str, node_id: str) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from orchestrator.state.keeper import Keeper

        return Keeper.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(node)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        self._connected()
        return self._ray.get(refs, timeout=timeout)

    def wait(self, refs: list, num_returns: int, timeout: float | None) -> tuple[list, list]:
        self._connected()
        return self._ray.wait(refs, num_returns=num_returns, timeout=timeout)

    def _connected(self) -> None:
        """A call after the driver left Ray (an uploader thread outliving its job) fails; it must not start a
        local Ray instance in this process, as `ray.get` without a connection would."""
        if not self._ray.is_initialized():
            raise ConnectionError("not connected to Ray (the job's driver shut its connection down)")

    def alive_nodes(self) -> dict[str, str]:
        from orchestrator.cluster.discovery import node_ids

        return node_ids()


class NodeGone(Exception):
    """A call to a keeper (or worker) on a node that `LocalCalls.kill` took away."""


class Answer:
    """A call already answered: its value, or the exception it raised."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        try:
            self.value, self.error = fn(*args, **kw), None
        except Exception as e:  # noqa: BLE001 - raised again by `result`, as ray.get would
            self.value, self.error = None, e

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class LocalHandle:
    """`handle.method.remote(*args)` on a plain object, answered at once; every call fails once its node is gone."""

    def __init__(self, obj: Any, node: str, calls: LocalCalls):
        self._obj, self._node, self._calls = obj, node, calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._obj, name)
        calls, node = self._calls, self._node

        class _Method:
            @staticmethod
            def remote(*args: Any, **kw: Any) -> Answer:
                if node in calls.dead:
                    return Answer(_raise, NodeGone(f"node {node} is gone"))
                return Answer(fn, *args, **kw)

        return _Method


def _raise(e: Exception) -> NoReturn:
    raise e


class LocalCalls:
    """The in-process fake: nodes by name, keepers as `KeeperStore` objects; `kill(node)` takes a node away."""

    lost = (NodeGone,)

    def __init__(self, nodes: list[str]):
        self.nodes, self.dead = list(nodes), set[str]()
        self.keepers: dict[str, Any] = {}  # node -> its KeeperStore, for tests to look into

    def start_keeper(self, node: str, node_id: str) -> LocalHandle:
        from orchestrator.state.keeper import KeeperStore

        self.keepers[node] = KeeperStore(node)
        return LocalHandle(self.keepers[node], node, self)

    def handle(self, obj: Any, node: str) -> LocalHandle:
        return LocalHandle(obj, node, self)

    def get(self, refs: Any, timeout: float | None = None) -> Any:
        return [r.result() for r in refs] if isinstance(refs, list) else refs.result()

    def wait(self, refs: list, num_returns: int, timeout: float | None) -> tuple[list, list]:
        return list(refs), []

    def alive_nodes(self) -> dict[str, str]:
        return {n: n for n in self.nodes if n not in self.dead}

    def kill(self, node: str) -> None:
        self.dead.add(node)
