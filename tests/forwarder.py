"""Loopback TCP forwarding in threads, opened when a test says: an agent process can be
started early, dialling a port where nothing listens yet, and reach the control plane
the moment the test opens the way (an agent's start-up, a Python process, takes seconds
on a busy machine; its redial, at most its backoff cap)."""

from __future__ import annotations

import socket
import threading


class Forwarder:
    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port, self.target_port = listen_port, target_port
        self._server: socket.socket | None = None

    def open(self) -> None:
        """Listen on `listen_port` from now on; each connection is relayed to the target."""
        self._server = socket.create_server(("127.0.0.1", self.listen_port))
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            # shutdown wakes the thread blocked in accept(); close alone would not.
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:  # closed
                return
            try:
                target = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the target is gone: so is this connection
                client.close()
                continue
            pair = _Pair(client, target)
            for source, sink in ((client, target), (target, client)):
                threading.Thread(target=pair.pump, args=(source, sink), daemon=True).start()


class _Pair:
    """One relayed connection: each direction pumped by its own thread, both sockets
    closed by the second to end."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.sockets = (a, b)
        self._ended = 0
        self._lock = threading.Lock()

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            self._ended += 1
            last = self._ended == 2
        if last:
            for s in self.sockets:
                s.close()
