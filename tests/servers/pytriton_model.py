"""A PyTriton server for tests, written as PyTriton's docs write one: a Python function bound as the
model "doubler" (doubles its FP32 input "x" into "doubled"; no weights, no model hub) with
``pytriton.triton.Triton``, then ``serve()``. PyTriton starts the tritonserver its wheel bundles and
talks to it over unix sockets in its workspace under ``~/.cache/pytriton``. The ports and the
address come from the command line (the agent's ``{port:NAME}``); SIGINT stops it cleanly
(``serve()`` ends on KeyboardInterrupt and removes its workspace)."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def infer(requests: list[Any]) -> list[dict[str, np.ndarray]]:
    return [{"doubled": (request["x"] * 2).astype(np.float32)} for request in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--address", default="127.0.0.1", help="where its servers listen")
    args = parser.parse_args()
    config = TritonConfig(
        http_address=args.address,
        http_port=args.http_port,
        grpc_address=args.address,
        grpc_port=args.grpc_port,
        metrics_address=args.address,
        metrics_port=args.metrics_port,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="doubler",
            infer_func=infer,
            inputs=[Tensor(name="x", dtype=np.float32, shape=(-1,))],
            outputs=[Tensor(name="doubled", dtype=np.float32, shape=(-1,))],
            config=ModelConfig(batching=False),
        )
        triton.serve()


if __name__ == "__main__":
    main()
