"""An MLServer model for tests: doubles its FP32 input (no weights, no model hub). Loaded by
MLServer from the model's directory (model-settings.json names ``mlserver_model.Doubler``)."""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class Doubler(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        data = NumpyCodec.decode_input(payload.inputs[0])
        output = NumpyCodec.encode_output("doubled", data * 2)
        return InferenceResponse(model_name=self.name, outputs=[output])
