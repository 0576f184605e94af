"""A Triton Python-backend model for tests: "doubler" doubles its FP32 input "x" into "doubled" (no
weights, no model hub). Copied to <repository>/doubler/1/model.py; its config.pbtxt is written by
tests/servers/heavy.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend


class TritonPythonModel:
    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            doubled = pb_utils.Tensor("doubled", (given * 2).astype(np.float32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[doubled]))
        return responses
