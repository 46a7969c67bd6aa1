"""OpenVINO: the export's FP32 and INT8 ONNX graphs as they are, compiled by Intel's runtime for the CPU. An optional
extra (`pip install 'capsnet-serve[openvino]'`) that `--backend auto` races against ONNX Runtime where it is installed;
which is faster depends on the CPU kind and the precision (docs/serving.md, "OpenVINO").

Through the OpenVINO runtime itself, not ONNX Runtime's OpenVINO execution provider: the provider ships as its own
build of ONNX Runtime (`onnxruntime-openvino`, the same `onnxruntime` module), so it cannot be installed beside the
ONNX Runtime the server depends on, and it lags its releases.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.backend_table import BACKEND_TABLE
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.base import Backend
from capsnet.serving.engine.backends.onnxruntime_backend import check_graph_matches, onnx_file

INSTALL = "pip install 'capsnet-serve[openvino]'"
# One batch at a time on `threads` cores (the batcher's), answered as soon as it is computed: one stream, the latency
# hint. The throughput hint's streams would split the cores between batches the batcher never runs side by side.
# Pinned to f32: on a CPU with native bf16 (AVX512_BF16, AMX) OpenVINO otherwise computes an FP32 graph in bf16,
# which the FP32 self-check (1e-4) refuses; the INT8 graph's float parts stay in f32 as ONNX Runtime computes them,
# which is what its precision gate measured. The batch axis stays dynamic: compiled shapes per batch size measured no
# faster (docs/serving.md).
COMPILE_CONFIG: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": 1, "INFERENCE_PRECISION_HINT": "f32",
                                  "ENABLE_CPU_PINNING": False}


def import_openvino():
    try:
        import openvino
    except ImportError:
        raise CapsNetError(f"--backend openvino: OpenVINO is not installed ({INSTALL})") from None
    return openvino


class OpenVinoBackend(Backend):
    name = "openvino"

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> OpenVinoBackend:
        return cls(artifacts, "fp32" if precision == "auto" else precision, config.intra_op_threads)

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int,
                 compile_config: dict[str, Any] | None = None):
        """`compile_config` replaces COMPILE_CONFIG's entries it names (for measurements of other settings)."""
        if not BACKEND_TABLE[self.name].serves(precision, "cpu"):
            others = [row.name for row in BACKEND_TABLE.values() if precision in row.precisions]
            raise CapsNetError(f"the openvino backend runs the export's "
                               f"{' and '.join(BACKEND_TABLE[self.name].cpu_precisions)} graphs; --precision "
                               f"{precision} needs {' or '.join(others) or 'another export'}")
        openvino = import_openvino()
        path = onnx_file(artifacts, precision)
        settings = {**COMPILE_CONFIG, "INFERENCE_NUM_THREADS": threads, **(compile_config or {})}
        try:
            core = openvino.Core()
            model = core.read_model(str(path))
            _check_ports(path, artifacts, model)
            compiled = core.compile_model(model, "CPU", settings)
        except CapsNetError:
            raise
        except Exception as err:  # OpenVINO raises RuntimeError for a damaged file or an unsupported graph
            raise CapsNetError(f"{path} is damaged or cannot be compiled by OpenVINO: {first_line(err)}") from None
        self.request = compiled.create_infer_request()
        self.outputs = {name: compiled.output(name) for name in artifacts.output_names}
        self.input_name = artifacts.input_name
        self.output_names = artifacts.output_names
        self.precision = precision
        arithmetic = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.description = (f"{path.name} on OpenVINO {openvino.get_version().split('-')[0]} CPU, {threads} threads, "
                            f"{settings['PERFORMANCE_HINT'].lower()} hint, {arithmetic} arithmetic")

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        results = self.request.infer({self.input_name: images})
        # the request's output tensors are reused by its next run: each answer gets its own copy
        return {name: np.array(results[output]) for name, output in self.outputs.items()}


def _check_ports(path: Path, artifacts: ModelArtifacts, model) -> None:
    """The graph's inputs and outputs are model.json's (check_graph_matches, as ONNX Runtime's backend checks them)."""
    def port(node) -> SimpleNamespace:
        shape = [dim.get_length() if dim.is_static else None for dim in node.get_partial_shape()]
        element = "tensor(float)" if node.get_element_type().get_type_name() == "f32" else str(node.get_element_type())
        return SimpleNamespace(name=node.get_any_name(), type=element, shape=shape)

    outputs = {}
    for node in model.outputs:
        for name in node.get_names():
            outputs[name] = port(node)
    missing = [name for name in artifacts.output_names if name not in outputs]
    if missing:
        raise CapsNetError(f"{path} is damaged: outputs {', '.join(missing)} listed in model.json are not in the graph")
    check_graph_matches(path, artifacts, [port(node) for node in model.inputs], outputs)
