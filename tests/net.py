"""A free local port, for the tests' rendezvous stores and for an endpoint that must refuse."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on when this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
