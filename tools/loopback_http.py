"""`LoopbackHTTP`: a small threaded HTTP/1.1 server on 127.0.0.1 for the test doubles that stand in front of
a real vLLM server (a proxy with its own weight label, a redirecting front, a fault-arming proxy).

Owns the socket work those doubles share: reading a request, writing an answer with its length, keeping
connections alive like vLLM does, and `stop`, which closes the listener and every open connection (as the
kernel closes a killed process's sockets), so a client's pooled connection never reaches a dead double.
Does not know what the requests mean: `answer(method, path, body)` returns `(status, body)` or
`(status, body, headers)`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = Callable[[str, str, bytes], tuple]


class LoopbackHTTP:
    """Serves `answer` on 127.0.0.1:`port` (0: a free one) from a daemon thread until `stop`."""

    def __init__(self, answer: Answer, port: int = 0) -> None:
        self.connections: set[socket.socket] = set()
        served = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # one small response must not wait for a delayed ACK (40 ms)

            def setup(self) -> None:
                super().setup()
                served.connections.add(self.connection)

            def finish(self) -> None:
                served.connections.discard(self.connection)
                super().finish()

            def _handle(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, data, *headers = answer(method, self.path, body)
                self.send_response(status)
                for name, value in (headers[0] if headers else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def log_message(self, *args) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True  # a restart on the same port right after `stop`
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """The port refuses connections, and kept-alive ones are closed."""
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
