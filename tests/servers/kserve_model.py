"""A KServe model server for tests, the usual model.py of KServe's examples: a ``kserve.Model`` named
by ``args.model_name`` (kserve's own argument parser, extended) that doubles its FP32 input (no
weights, no model hub), started with ``kserve.ModelServer().start([...])``. The agent's preset adds
--http_port, --grpc_port, --workers, --max_threads and --model_name, which that parser reads."""

from __future__ import annotations

import argparse
from typing import Any

from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer, model_server


class Doubler(Model):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.load()

    def load(self) -> bool:
        self.ready = True
        return self.ready

    async def predict(
        self,
        payload: dict[str, Any] | InferRequest,
        headers: dict[str, str] | None = None,
        response_headers: dict[str, str] | None = None,
    ) -> dict[str, Any] | InferResponse:
        if isinstance(payload, InferRequest):
            given = payload.inputs[0]
            doubled = [2 * x for x in given.data]
            output = InferOutput(name="doubled", shape=list(given.shape), datatype="FP32", data=doubled)
            return InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=[output])
        return {"predictions": [2 * x for x in payload["instances"]]}


parser = argparse.ArgumentParser(parents=[model_server.parser])
args, _ = parser.parse_known_args()

if __name__ == "__main__":
    ModelServer().start([Doubler(args.model_name)])
