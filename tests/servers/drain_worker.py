"""A worker that shows how it was stopped (run by tests in a slot; stdlib only).

Serves GET /ready, GET /slow (answers after 1.5 s, saying whether POST /drain came first) and
POST /drain. SIGINT ends it gracefully: requests under way finish, then exit 0. SIGTERM is ignored,
so a stop that sent SIGTERM ends in SIGKILL. A forked helper reports the signal it got and exits.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time

drained = threading.Event()


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow":
            print("slow request started", flush=True)
            time.sleep(1.5)
            self._answer(200, {"drain_called": drained.is_set()})
        elif self.path == "/ready":
            self._answer(200, {"ready": True})
        else:
            self._answer(404, {})

    def do_POST(self) -> None:
        if self.path == "/drain":
            drained.set()
            print("pre_stop /drain called", flush=True)
            self._answer(200, {})
        else:
            self._answer(404, {})

    def _answer(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        return None


def helper() -> None:
    def report(sig: int, frame: object) -> None:
        print(f"helper {os.getpid()} got {signal.Signals(sig).name}", flush=True)
        os._exit(0)

    signal.signal(signal.SIGINT, report)
    signal.signal(signal.SIGTERM, report)
    while True:
        signal.pause()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if os.fork() == 0:
        helper()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = False  # server_close() waits for requests under way
    stopping = threading.Event()
    signal.signal(signal.SIGINT, lambda sig, frame: stopping.set())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"serving on {args.port}", flush=True)
    stopping.wait()
    print("SIGINT: finishing requests under way", flush=True)
    server.shutdown()
    server.server_close()
    print("stopped", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
