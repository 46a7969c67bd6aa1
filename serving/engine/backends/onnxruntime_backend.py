"""ONNX Runtime: the default backend. CPU everywhere; TensorRT and CUDA execution providers first
when onnxruntime-gpu is installed and a GPU answers (ONNX Runtime falls back to the CPU otherwise)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnxruntime as ort

from capsnet.errors import CapsNetError, first_line
from capsnet.model_description.files import ONNX_FP16_NAME, ONNX_INT8_NAME
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.base import Backend

log = logging.getLogger(__name__)

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def gpu_providers_installed() -> list[str]:
    return [p for p in GPU_PROVIDERS if p in ort.get_available_providers()]


def onnx_file(artifacts: ModelArtifacts, precision: str) -> Path:
    """The export's ONNX graph in `precision`; CapsNetError saying why there is none."""
    path = artifacts.onnx.get(precision)
    if path is None:
        file = {"int8": ONNX_INT8_NAME, "fp16": ONNX_FP16_NAME}.get(precision)
        if file in artifacts.refused:  # asked for at export, and the precision gate refused it there
            raise CapsNetError(f"{artifacts.directory} has no {precision} ONNX model: the export did not write "
                               f"{file}: {artifacts.refused[file]}")
        raise CapsNetError(f"{artifacts.directory} has no {precision} ONNX model; export it with --{precision}")
    return path


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        if device == "gpu" and not gpu_providers_installed():
            return "onnxruntime-gpu is not installed"
        return None

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> OnnxRuntimeBackend:
        return cls(artifacts, precision, config.intra_op_threads, config.max_batch_size, config.gpu_or_first)

    def __init__(self, artifacts: ModelArtifacts, precision: str, threads: int, max_batch_size: int, gpu: int = 0):
        path = onnx_file(artifacts, precision)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # The batcher runs one batch at a time, so parallelism is within operators.
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning intra-op threads busy-wait for the next operator's work, and so between requests too: a
        # server then burns its cores while idle and takes them from the RPC threads. Off, they sleep.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), options,
                                                providers=self._providers(artifacts, precision, max_batch_size, gpu))
        except Exception as err:  # onnxruntime raises its own exception types (InvalidProtobuf, Fail, ...)
            raise CapsNetError(f"{path} is damaged or cannot be loaded: {first_line(err)}") from None
        graph_outputs = {output.name: output for output in self.session.get_outputs()}
        missing = [name for name in artifacts.output_names if name not in graph_outputs]
        if missing:
            raise CapsNetError(f"{path} is damaged: outputs {', '.join(missing)} listed in model.json are not in the "
                               "graph")
        check_graph_matches(path, artifacts, self.session.get_inputs(), graph_outputs)
        self.input_name = artifacts.input_name
        self.output_names = artifacts.output_names
        self.precision = precision
        self.on_gpu = self.session.get_providers()[0] in GPU_PROVIDERS  # else it fell back to the CPU
        self.description = f"{path.name} on {', '.join(self.session.get_providers())}, {threads} threads"

    @staticmethod
    def _providers(artifacts: ModelArtifacts, precision: str, max_batch_size: int, gpu: int) -> list:
        """GPU providers on CUDA device `gpu` (both default to device 0 otherwise), then the CPU."""
        providers: list = []
        installed = gpu_providers_installed()
        if "TensorrtExecutionProvider" in installed:
            # One optimisation profile over the batch sizes the batcher produces, built once at startup.
            shape = "x".join(map(str, artifacts.input_shape))
            providers.append(("TensorrtExecutionProvider", {
                "device_id": gpu,
                "trt_fp16_enable": precision == "fp16",
                "trt_int8_enable": precision == "int8",  # the int8 model carries its own Q/DQ scales
                "trt_profile_min_shapes": f"{artifacts.input_name}:1x{shape}",
                "trt_profile_opt_shapes": f"{artifacts.input_name}:{max_batch_size}x{shape}",
                "trt_profile_max_shapes": f"{artifacts.input_name}:{max_batch_size}x{shape}",
            }))
        if "CUDAExecutionProvider" in installed:
            providers.append(("CUDAExecutionProvider", {"device_id": gpu}))
        providers.append("CPUExecutionProvider")
        return providers

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        outputs = self.session.run(list(self.output_names), {self.input_name: images})
        return dict(zip(self.output_names, outputs))


def check_graph_matches(path, artifacts: ModelArtifacts, graph_inputs: list, graph_outputs: dict) -> None:
    """The graph's input and output shapes are model.json's: another model's ONNX file (its hash rewritten to match)
    would otherwise fail on every request, or answer with shapes the server describes differently to clients."""
    def static(node) -> list:  # without the batch axis; a symbolic dimension (a name, or None) matches anything
        return [d if isinstance(d, int) else None for d in node.shape[1:]]

    def differs(dims: list, shape: tuple[int, ...]) -> bool:
        return len(dims) != len(shape) or any(d is not None and d != s for d, s in zip(dims, shape))

    names = [node.name for node in graph_inputs]
    if names != [artifacts.input_name]:
        raise CapsNetError(f"{path} takes inputs {names}, model.json says {[artifacts.input_name]}; re-export it")
    (graph_input,) = graph_inputs
    if graph_input.type != "tensor(float)" or differs(static(graph_input), artifacts.input_shape):
        raise CapsNetError(f"{path} takes {graph_input.type} {graph_input.shape}, model.json says float32 "
                           f"[N, {', '.join(map(str, artifacts.input_shape))}]; re-export it")
    for name, shape in artifacts.output_shapes.items():
        output = graph_outputs[name]
        if differs(static(output), shape):
            raise CapsNetError(f"{path} gives {name} of shape {output.shape}, model.json says "
                               f"[N, {', '.join(map(str, shape))}]; re-export it")
