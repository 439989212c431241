"""TCP ports for what a test starts (a launcher's rendezvous, an S3 server, Slurm's daemons): the kernel's choice
of ports nobody listens on now, never a fixed number that another test, or another session's, may hold."""

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports nobody listens on now (all picked while each is still held)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def free_port() -> int:
    """One port nobody listens on now: for a server the test starts, or a closed port to fail against."""
    return free_ports(1)[0]
