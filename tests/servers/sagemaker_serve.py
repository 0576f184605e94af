"""A bring-your-own-container `serve` for the SageMaker serving contract, as AWS's examples build
one: an HTTP server on the port SAGEMAKER_BIND_TO_PORT names (8080 without it), healthy while GET
/ping answers 200, inference at POST /invocations. Its "model" doubles the JSON it is sent:
{"instances": [1.0, 2.5]} -> {"predictions": [2.0, 5.0]}. Standard library only; installed as
<base>/bin/serve with a world-runnable Python in its #! line (tests/servers/heavy.py).

SIGTERM (SageMaker's stop, and the agent's) shuts the server down cleanly: requests under way are
finished, the process exits 0."""

from __future__ import annotations

import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/ping" else 404)

    def do_POST(self) -> None:
        if self.path != "/invocations":
            self._send(404)
            return
        try:
            given = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            answer = {"predictions": [2 * float(v) for v in given["instances"]]}
        except (ValueError, KeyError, TypeError) as err:
            self._send(400, json.dumps({"error": str(err)}).encode())
            return
        self._send(200, json.dumps(answer).encode())

    def log_message(self, format: str, *args: Any) -> None:
        return


def main() -> None:
    server = ThreadingHTTPServer(("0.0.0.0", int(os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080"))), Handler)
    server.daemon_threads = False
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    main()
