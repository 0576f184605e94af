"""A small, real inference server speaking the Open Inference Protocol (KServe v2) over HTTP.

It serves one model, an MLP with seeded weights in NumPy, so every run and every host computes the
same outputs for the same inputs. Used by the README quickstart, the tests and the benchmarks.

    python examples/oip_worker.py --port 8000 [--model mlp] [--inputs 64 --hidden 256 --outputs 10]

Endpoints: GET /v2/health/live, /v2/health/ready, /v2/models/{name}, /v2/models/{name}/ready,
/v2/models/{name}/stats (latency p50/p99 in microseconds), POST /v2/models/{name}/infer.
Each inference response carries its server-side latency in the ``X-Inference-Latency-Us`` header.

Threads: NumPy's BLAS reads OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS when it is
first imported, so the server sets them from the slot before importing NumPy if they are unset
(the agent sets them; running by hand, they default to the CPUs this process may use). The port
comes from --port, else $PORT, else 8000. SIGTERM stops it gracefully: in-flight requests finish.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _var in _THREAD_VARS:
    os.environ.setdefault(_var, os.environ.get("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0)))))

import numpy as np  # noqa: E402 - must follow the thread-count set-up above


class MLP:
    """Dense ReLU layers with weights drawn from a seeded generator; FP32 in, FP32 out."""

    def __init__(self, sizes: list[int], seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.sizes = sizes
        self.layers = [
            (
                rng.standard_normal((n_in, n_out), dtype=np.float32) / np.float32(np.sqrt(n_in)),
                np.zeros(n_out, dtype=np.float32),
            )
            for n_in, n_out in itertools.pairwise(sizes)
        ]

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        out = batch
        for index, (weights, bias) in enumerate(self.layers):
            out = out @ weights + bias
            if index < len(self.layers) - 1:
                out = np.maximum(out, 0)
        return out


class LatencyStats:
    """Recent request latencies (a bounded window) and totals."""

    def __init__(self, window: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._recent.append(seconds)
            self.count += 1

    def summary(self) -> dict[str, Any]:
        with self._lock:
            recent = np.array(self._recent) if self._recent else np.zeros(0)
            count = self.count
        if recent.size == 0:
            return {"count": count, "p50_us": None, "p99_us": None}
        p50, p99 = np.percentile(recent, [50, 99]) * 1e6
        return {
            "count": count,
            "window": int(recent.size),
            "p50_us": round(float(p50), 1),
            "p99_us": round(float(p99), 1),
        }


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # Let in-flight requests finish on shutdown.
    block_on_close = True

    def __init__(self, address: tuple[str, int], model_name: str, model: MLP) -> None:
        super().__init__(address, Handler)
        self.model_name = model_name
        self.model = model
        self.stats = LatencyStats()
        self.ready = True


_MODEL_PATH = re.compile(r"^/v2/models/(?P<name>[^/]+)(?:/versions/[^/]+)?(?P<rest>/ready|/infer|/stats)?$")


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"
    # A response goes out in two writes (headers, then body). With Nagle's algorithm on, the body
    # waits for the client's delayed ACK of the headers (up to 40 ms) on a kept-alive connection:
    # above ~150 inferences a second the server stalled with a CPU almost idle.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: one line per request would drown the worker's real logs."""

    def _send(
        self, status: HTTPStatus, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        payload = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(payload)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, {"error": message})

    def do_GET(self) -> None:
        if self.path == "/v2/health/live":
            self._send(HTTPStatus.OK, {"live": True})
            return
        if self.path == "/v2/health/ready":
            self._send(
                HTTPStatus.OK if self.server.ready else HTTPStatus.SERVICE_UNAVAILABLE,
                {"ready": self.server.ready},
            )
            return
        if self.path == "/v2":
            self._send(HTTPStatus.OK, {"name": "nodeagent-oip-worker", "version": "1", "extensions": []})
            return
        match = _MODEL_PATH.match(self.path)
        if match is None or match["name"] != self.server.model_name:
            self._error(
                HTTPStatus.NOT_FOUND,
                f"no model at {self.path}; this server serves {self.server.model_name!r}",
            )
            return
        rest = match["rest"]
        if rest == "/ready":
            self._send(
                HTTPStatus.OK if self.server.ready else HTTPStatus.SERVICE_UNAVAILABLE,
                {"name": match["name"], "ready": self.server.ready},
            )
        elif rest == "/stats":
            self._send(HTTPStatus.OK, {"name": match["name"], "latency": self.server.stats.summary()})
        elif rest is None:
            sizes = self.server.model.sizes
            self._send(
                HTTPStatus.OK,
                {
                    "name": match["name"],
                    "versions": ["1"],
                    "platform": "numpy",
                    "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, sizes[0]]}],
                    "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, sizes[-1]]}],
                },
            )
        else:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST for {self.path}")

    def do_POST(self) -> None:
        started = time.perf_counter()
        match = _MODEL_PATH.match(self.path)
        if match is None or match["rest"] != "/infer" or match["name"] != self.server.model_name:
            self._error(HTTPStatus.NOT_FOUND, f"no inference endpoint at {self.path}")
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
            request = json.loads(self.rfile.read(length))
            batch = self._input(request)
        except (ValueError, KeyError, TypeError) as err:
            self._error(HTTPStatus.BAD_REQUEST, f"bad inference request: {err}")
            return
        result = self.server.model(batch)
        body: dict[str, Any] = {
            "model_name": self.server.model_name,
            "model_version": "1",
            "outputs": [
                {
                    "name": "output",
                    "datatype": "FP32",
                    "shape": list(result.shape),
                    "data": result.ravel().tolist(),
                }
            ],
        }
        if "id" in request:
            body["id"] = request["id"]
        elapsed = time.perf_counter() - started
        self.server.stats.add(elapsed)
        self._send(HTTPStatus.OK, body, {"X-Inference-Latency-Us": f"{elapsed * 1e6:.1f}"})

    def _input(self, request: dict[str, Any]) -> np.ndarray:
        inputs = request["inputs"]
        if not isinstance(inputs, list) or len(inputs) != 1:
            raise ValueError("give exactly one input tensor")
        tensor = inputs[0]
        if tensor.get("datatype") != "FP32":
            raise ValueError(f"datatype {tensor.get('datatype')!r} is not supported; use FP32")
        shape = [int(d) for d in tensor["shape"]]
        width = self.server.model.sizes[0]
        if len(shape) != 2 or shape[1] != width:
            raise ValueError(f"shape {shape} does not match [batch, {width}]")
        data = np.asarray(tensor["data"], dtype=np.float32)
        return data.reshape(shape)


def default_host() -> str:
    """Loopback, unless the slot gave us a network namespace of our own: then every address in it
    is the slot's, and the agent (and clients) reach us on the slot's address from outside."""
    if "HOST" in os.environ:
        return os.environ["HOST"]
    slot_file = os.environ.get("NODEAGENT_SLOT_FILE")
    if slot_file:
        try:
            with open(slot_file) as f:
                if json.load(f).get("addresses"):
                    return "0.0.0.0"  # noqa: S104 - only inside the slot's own netns
        except (OSError, ValueError):
            pass
    return "127.0.0.1"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=default_host())
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    parser.add_argument("--model", default=os.environ.get("MODEL_NAME", "mlp"))
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2, help="hidden layers")
    parser.add_argument("--outputs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sizes = [args.inputs] + [args.hidden] * args.layers + [args.outputs]
    server = Server((args.host, args.port), args.model, MLP(sizes, seed=args.seed))

    def stop(signum: int, frame: object) -> None:
        server.ready = False
        # shutdown() waits for serve_forever to return, so it must run on another thread.
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    threads = os.environ.get("OMP_NUM_THREADS")
    print(
        f"serving model {args.model!r} {sizes} on {args.host}:{server.server_port}, {threads} BLAS threads",
        flush=True,
    )
    server.serve_forever()
    server.server_close()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
