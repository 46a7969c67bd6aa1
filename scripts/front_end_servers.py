"""The servers scripts/bench_front_end.py sets beside `capsnet serve`, each serving one export's `model.onnx` over
KServe v2 gRPC and printing `ready` once it listens (run as `bench_front_end.py --floor|--pytriton|--kserve PORT`):

- floor: a grpc.aio server that decodes each request's tensor and answers fixed outputs of the model's shapes, or
  with an engine the engine's outputs on each request's images: what Python gRPC itself costs a request, and the
  least a Python gRPC server that runs the model costs, with no checks, batching, statistics or metrics;
- pytriton: Triton's server through PyTriton, ONNX Runtime in its Python model with dynamic batching;
- kserve: KServe's Python model server (kserve 0.21) with a `kserve.Model` that runs the file in ONNX Runtime (one
  thread, no batching, its request logging off), as a user choosing a plain Python server would write it.

They run in Pythons without the project where they must (PyTriton, KServe): only numpy, onnxruntime and their
server are imported at module level.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np

MODEL = "capsnet"
COUNTS = struct.Struct("<QQ")  # requests answered, images inferred: what a server without statistics writes


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_io(model_dir: Path) -> tuple[list[int], dict[str, list[int]]]:
    description = json.loads((model_dir / "model.json").read_text())
    outputs = {output["name"]: list(output["shape"]) for output in description["outputs"]}
    return list(description["input"]["shape"]), outputs


# -- the floor: grpc.aio, the tensor decoded, fixed outputs --------------------------------------------------------

def floor(model_dir: Path, port: int, engine: str | None, gpu: int | None, max_batch: int) -> None:
    """`engine` (BACKEND:PRECISION, built by capsnet.bench.engines as `capsnet serve --max-batch-size max_batch` builds
    it): each request's outputs are the engine's on its images, else fixed zeros."""
    import grpc
    from google.protobuf import json_format

    from capsnet.kserve import grpc_service_pb2 as pb
    from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc

    image, outputs = model_io(model_dir)
    answers = {name: np.zeros(shape, np.float32).tobytes() for name, shape in outputs.items()}
    backend = None
    if engine is not None:
        from capsnet.bench.engines import build_engine

        backend = build_engine(engine, model_dir, threads=0, max_batch=max_batch, gpu=gpu)
        # compiled and warm before the first request, as capsnet serve's engine is
        backend.run(np.zeros((1, *image), np.float32))
    count = images_run = 0  # requests answered; images the engine ran, each request its own run

    class Floor(pb_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="floor", version="1")

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=True)

        async def ModelMetadata(self, request, context):
            return json_format.ParseDict({
                "name": MODEL, "versions": ["1"], "platform": "onnxruntime_onnx",
                "inputs": [{"name": "images", "datatype": "FP32", "shape": [-1, *image]}],
                "outputs": [{"name": name, "datatype": "FP32", "shape": [-1, *shape]}
                            for name, shape in outputs.items()]}, pb.ModelMetadataResponse())

        async def ModelConfig(self, request, context):
            return pb.ModelConfigResponse.FromString(model_config_response(model_dir))

        async def ModelStatistics(self, request, context):
            stats = {"name": MODEL, "version": "1", "inference_count": images_run,
                     "execution_count": 0 if backend is None else count,
                     "inference_stats": {"success": {"count": count}}}
            return json_format.ParseDict({"model_stats": [stats]}, pb.ModelStatisticsResponse())

        async def ModelInfer(self, request, context):
            nonlocal count, images_run
            tensor = request.inputs[0]
            images = np.frombuffer(request.raw_input_contents[0], np.float32).reshape(tensor.shape)  # (N, C, H, W)
            response = pb.ModelInferResponse(model_name=MODEL, model_version="1", id=request.id)
            computed = None
            if backend is not None:
                computed = backend.run(images)
                images_run += len(images)
            for name, shape in outputs.items():
                response.outputs.add(name=name, datatype="FP32", shape=[len(images), *shape])
                response.raw_output_contents.append(answers[name] * len(images) if computed is None
                                                    else np.ascontiguousarray(computed[name], "<f4").tobytes())
            count += 1
            return response

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(Floor(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(run())


# -- PyTriton: Triton's server, ONNX Runtime in its Python model ---------------------------------------------------

def pytriton(model_dir: Path, port: int, max_batch_size: int) -> None:
    import onnxruntime
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    # Triton's Python backend stub loads this interpreter's libpython: where a build keeps it outside the linker's
    # paths (pyenv), tell the server's processes
    libdir = sysconfig.get_config_var("LIBDIR")
    os.environ["LD_LIBRARY_PATH"] = ":".join(filter(None, [libdir, os.environ.get("LD_LIBRARY_PATH")]))
    image, outputs = model_io(model_dir)
    session = onnxruntime.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs() if output.name in outputs]

    @batch
    def infer(images):
        return dict(zip(names, session.run(names, {"images": images})))

    config = TritonConfig(grpc_port=port, http_port=free_port(), metrics_port=free_port())
    # every endpoint open, as capsnet serve's are: perf_analyzer reads the statistics, which PyTriton guards by default
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        triton.bind(model_name=MODEL, infer_func=infer,
                    inputs=[Tensor(name="images", dtype=np.float32, shape=tuple(image))],
                    outputs=[Tensor(name=name, dtype=np.float32, shape=tuple(outputs[name])) for name in names],
                    config=ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher()))
        print("ready", flush=True)
        triton.serve()


def model_config_response(model_dir: Path) -> bytes:
    """Triton's ModelConfigResponse for the export, serialised: what perf_analyzer asks a server first."""
    from google.protobuf import json_format

    from capsnet.kserve import grpc_service_pb2 as pb
    from capsnet.kserve import model_config_pb2 as config_pb

    image, outputs = model_io(model_dir)
    config = json_format.ParseDict({
        "name": MODEL, "platform": "onnxruntime_onnx", "max_batch_size": 64,
        "input": [{"name": "images", "data_type": "TYPE_FP32", "dims": image}],
        "output": [{"name": name, "data_type": "TYPE_FP32", "dims": shape} for name, shape in outputs.items()],
        "dynamic_batching": {}}, config_pb.ModelConfig())
    return pb.ModelConfigResponse(config=config).SerializeToString()


# -- KServe: its Python model server, ONNX Runtime in a kserve.Model ----------------------------------------------

def kserve_server(model_dir: Path, port: int, counts: Path, threads: int = 1) -> None:
    """KServe 0.21's ModelServer on gRPC `port` (REST on a free one); `counts` receives COUNTS after every request,
    as KServe serves no statistics. KServe serves no model config either, which perf_analyzer asks first: its gRPC
    server answers the one in `counts`.config (model_config_response(), written by the benchmark, whose Python has
    the protocol's messages), as raw bytes. ONNX Runtime runs on `threads` intra-op threads, which sleep between
    operators as capsnet's do."""
    import logging

    import grpc
    import kserve
    import onnxruntime
    from kserve import InferOutput, InferRequest, InferResponse
    from kserve.protocol.grpc import grpc_predict_v2_pb2_grpc as services

    config = counts.with_suffix(".config").read_bytes()
    add_servicer = services.add_GRPCInferenceServiceServicer_to_server

    async def model_config(request: bytes, context) -> bytes:
        return config

    def add_with_config(servicer, server) -> None:
        add_servicer(servicer, server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService", {"ModelConfig": grpc.unary_unary_rpc_method_handler(model_config)}),))

    services.add_GRPCInferenceServiceServicer_to_server = add_with_config

    image, outputs = model_io(model_dir)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as capsnet's sessions
    fd = os.open(counts, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # this server's counts, from none
    answered = images_run = 0

    class OnnxModel(kserve.Model):
        def load(self) -> bool:
            self.session = onnxruntime.InferenceSession(str(model_dir / "model.onnx"), options,
                                                        providers=["CPUExecutionProvider"])
            self.names = [output.name for output in self.session.get_outputs() if output.name in outputs]
            self.ready = True
            return self.ready

        def get_input_types(self) -> list[dict]:
            return [{"name": "images", "datatype": "FP32", "shape": [-1, *image]}]

        def get_output_types(self) -> list[dict]:
            return [{"name": name, "datatype": "FP32", "shape": [-1, *outputs[name]]} for name in self.names]

        def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
            nonlocal answered, images_run
            images = payload.inputs[0].as_numpy()  # (N, C, H, W)
            results = self.session.run(self.names, {"images": images})
            answered += 1
            images_run += len(images)
            os.pwrite(fd, COUNTS.pack(answered, images_run), 0)
            answers = []
            for name, result in zip(self.names, results):
                answers.append(InferOutput(name=name, shape=list(result.shape), datatype="FP32"))
                answers[-1].set_data_from_numpy(result)
            return InferResponse(model_name=self.name, infer_outputs=answers, response_id=payload.id,
                                 use_binary_outputs=True)

    model = OnnxModel(MODEL)
    model.load()
    server = kserve.ModelServer(grpc_port=port, http_port=free_port(), enable_grpc=True, workers=1,
                                enable_latency_logging=False, access_log_format=None)
    logging.getLogger("kserve").setLevel(logging.WARNING)  # its interceptor logs every call at INFO
    threading.Thread(target=_print_ready_when_listening, args=(port,), daemon=True).start()
    server.start([model])


def _print_ready_when_listening(port: int) -> None:
    for _ in range(600):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                print("ready", flush=True)
                return
        time.sleep(0.1)
