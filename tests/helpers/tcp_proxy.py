"""A TCP proxy on 127.0.0.1 that a test cuts (every connection closed, new ones refused) or silences (connections
accepted and held, nothing forwarded either way: a network that drops packets without a word) and restores on
the same port: how an object store behind a failing network looks to a client, with the real server kept running."""

import socket
import threading


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` ("host", port) until ``cut()``; ``restore()`` listens again."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._silent = threading.Event()
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return listener

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by cut()
                return
            if self._silent.is_set():
                with self._lock:
                    self._open.add(client)  # held open, never answered
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            ended = []  # the directions of this connection that have ended: the second closes both sockets
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b, ended), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, ended: list) -> None:
        try:
            while data := source.recv(65536):
                if not self._silent.is_set():
                    sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:  # both closed once both directions end: left open, one run's connections held 1,100
                ended.append(source)
                if len(ended) == 2:
                    for s in (source, sink):
                        s.close()
                        self._open.discard(s)

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        try:
            # Wakes the accepting thread: close() alone leaves its accept() waiting, and it takes one more connection.
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for s in self._open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass
            self._open.clear()

    def silence(self) -> None:
        """Hold every connection, old and new, open without forwarding a byte."""
        self._silent.set()

    def restore(self) -> None:
        """Forward again (after ``silence``), or listen again on the same port (after ``cut``)."""
        if self._silent.is_set():
            self._silent.clear()
            return
        self._listener = self._listen(self.port)

    def close(self) -> None:
        self.cut()
