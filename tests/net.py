"""A free local port, for the tests' rendezvous stores and for an endpoint that must refuse."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on when this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_server(world_size: int, timeout_s: float = 60.0):
    """A process group's rendezvous store served by the test's process, on a port it binds and holds until the
    store is dropped: a port found free and bound later by a rank could be taken meanwhile (EADDRINUSE). Ranks in
    other processes join with `rendezvous_client(server.port, ...)`."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def rendezvous_client(port: int, world_size: int, timeout_s: float = 60.0):
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=timeout_s))
