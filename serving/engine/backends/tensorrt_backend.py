"""TensorRT: serves the serialized engine (model.plan) with capsnet.runtime.tensorrt_runner, the runner export's
parity check uses too. NOT RUN: TensorRT cannot be installed where this project is developed and tested.

An engine only runs on the TensorRT version and GPU it was built for, so model.plan.json is checked
against the configured GPU (`--gpu`) before the plan is deserialized: a mismatch is a clear startup error
instead of a deserialization failure (or silently slow kernels on a different GPU model).
"""

from __future__ import annotations

import logging

import numpy as np

from capsnet.errors import CapsNetError
from capsnet.runtime.tensorrt_runner import EngineRunner, gpu_facts, unavailable_reason
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import ModelArtifacts
from capsnet.serving.engine.backends.base import Backend

log = logging.getLogger(__name__)


class TensorRTBackend(Backend):
    name = "tensorrt"
    on_gpu = True

    @classmethod
    def create(cls, artifacts: ModelArtifacts, precision: str, config: ServerConfig) -> TensorRTBackend:
        return cls(artifacts, None if precision == "auto" else precision, config.max_batch_size, config.gpu_or_first)

    def __init__(self, artifacts: ModelArtifacts, precision: str | None, max_batch_size: int, gpu: int = 0):
        plan, info = artifacts.tensorrt_plan, artifacts.tensorrt_info
        if plan is None or info is None:  # load_artifacts reads the plan's description with the plan
            raise CapsNetError(f"{artifacts.directory} has no TensorRT plan; export it with --tensorrt on the serving "
                               "GPU")
        problem = unavailable_reason(gpu)
        if problem:
            raise CapsNetError(f"the tensorrt backend cannot run here: {problem}")
        import tensorrt as trt

        gpu_name, capability = gpu_facts(gpu)
        check_plan_matches(plan, info, trt.__version__, gpu_name, capability)
        if precision not in (None, info["precision"]):
            raise CapsNetError(f"{plan} is a {info['precision']} engine; --precision {precision} needs another export")
        if int(info["min_batch"]) != 1 or max_batch_size > int(info["max_batch"]):
            raise CapsNetError(f"the engine takes batches of {info['min_batch']} to {info['max_batch']} images, the "
                               f"batcher makes 1 to --max-batch-size {max_batch_size}; lower it or re-export")
        self.precision = info["precision"]
        self.output_names = artifacts.output_names
        try:
            self.runner = EngineRunner(plan.read_bytes(), artifacts.input_name, self.output_names, max_batch_size, gpu)
        except CapsNetError as err:
            raise CapsNetError(f"{plan}: {err}") from None
        self.description = f"{plan.name} ({self.precision}) on GPU {gpu} {gpu_name}, TensorRT {trt.__version__}"

    def run(self, images: np.ndarray) -> dict[str, np.ndarray]:
        return self.runner.run(images)

    def close(self) -> None:
        self.runner.close()


def check_plan_matches(plan, info: dict, trt_version: str, gpu_name: str, capability: str) -> None:
    if info["tensorrt_version"] != trt_version:
        raise CapsNetError(f"{plan} was built with TensorRT {info['tensorrt_version']}, this machine has "
                           f"{trt_version}; re-export with --tensorrt here")
    if str(info["compute_capability"]) != capability:
        raise CapsNetError(f"{plan} was built for {info['gpu_name']} (compute capability "
                           f"{info['compute_capability']}), this GPU is {gpu_name} ({capability}); re-export with "
                           "--tensorrt on this GPU")
    if info["gpu_name"] != gpu_name:
        # Same architecture: TensorRT loads it, but kernels were timed on the other model.
        log.warning("%s was built on %s, running on %s: re-export on this GPU for best speed", plan, info["gpu_name"],
                    gpu_name)
