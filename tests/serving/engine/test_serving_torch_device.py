"""The torch backend's device and bucket plumbing, walked on the CPU: the GPU path's padded batch buckets (static
tensors, one per bucket, reused by every batch) give what the plain model gives for every batch size, and a
device failure under a batch fails that batch with INTERNAL / 500, turns health NOT_SERVING and fails later batches
at once, never hanging or killing the server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving_helpers import ServerThread, server_config

from capsnet.client.api import image_message
from capsnet.errors import CapsNetError
from capsnet.runtime.torch_runner import bucket_for, bucket_sizes
from capsnet.serving.config import ServerConfig
from capsnet.serving.engine.artifacts import load_artifacts
from capsnet.serving.engine.backends.base import DeviceFailure
from capsnet.serving.engine.backends.torch_backend import TorchBackend
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc


def test_buckets_are_powers_of_two_up_to_the_max_batch():
    assert bucket_sizes(1) == (1,) and bucket_sizes(8) == (1, 2, 4, 8) and bucket_sizes(24) == (1, 2, 4, 8, 16, 24)
    assert [bucket_for(n, bucket_sizes(24)) for n in (1, 2, 3, 9, 16, 17, 24)] == [1, 2, 4, 16, 16, 24, 24]
    with pytest.raises(CapsNetError, match="a batch of 25 images is more than the largest bucket, 24"):
        bucket_for(25, bucket_sizes(24))


def test_bucketed_runs_give_the_plain_models_outputs_with_no_new_tensors(model_dir):
    artifacts = load_artifacts(model_dir)
    bucketed = TorchBackend(artifacts, "fp32", 1, None, 8, buckets=True)
    plain = TorchBackend(artifacts, "fp32", 1)
    assert bucketed.runner.buckets == (1, 2, 4, 8) and "eager for batch buckets 1/2/4/8" in bucketed.description
    static = {size: tensor.data_ptr() for size, tensor in bucketed.runner.inputs.items()}
    rng = np.random.default_rng(5)
    for batch in (8, 3, 1, 5, 2, 8, 7):  # smaller batches after larger ones: earlier rows stay in the padding
        images = rng.random((batch, 1, 28, 28), dtype=np.float32)
        got, expected = bucketed.run(images), plain.run(images)
        assert set(got) == {"probabilities", "poses", "reconstruction"}
        for name, value in got.items():  # a padded batch may take other kernel blocking: rounding apart
            assert value.shape[0] == batch, (batch, name)
            np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-9, err_msg=f"{batch} {name}")
    assert {size: tensor.data_ptr() for size, tensor in bucketed.runner.inputs.items()} == static


def test_a_batch_runs_the_model_once_for_all_its_outputs(model_dir):
    artifacts = load_artifacts(model_dir)
    calls: list[object] = []
    for backend in (TorchBackend(artifacts, "fp32", 1), TorchBackend(artifacts, "fp32", 1, None, 4, buckets=True)):
        hook = backend.model.register_forward_pre_hook(lambda module, _: calls.append(module))
        outputs = backend.run(np.zeros((3, 1, 28, 28), np.float32))
        hook.remove()
        assert len(outputs) == 3 and calls.count(backend.model) == 1, backend.description


def test_returned_arrays_are_the_callers_to_keep(model_dir):
    backend = TorchBackend(load_artifacts(model_dir), "fp32", 1, None, 4, buckets=True)
    first = backend.run(np.zeros((2, 1, 28, 28), np.float32))["probabilities"]
    kept = first.copy()
    backend.run(np.ones((2, 1, 28, 28), np.float32))  # the same bucket, its static outputs overwritten
    assert np.array_equal(first, kept)


def test_fp16_on_the_cpu_is_refused_in_one_line(model_dir):
    with pytest.raises(CapsNetError, match=r"--precision fp16 on the torch backend runs on a GPU: add --gpu N"):
        TorchBackend(load_artifacts(model_dir), "fp16", 1)
    with pytest.raises(CapsNetError,
                       match="--precision int8 is an ONNX model: the torch backend runs fp32, fp16 or bf16"):
        ServerConfig(model_dir=model_dir, backend="torch", precision="int8")


def test_loading_a_version_sets_torchs_threads_only_when_the_count_changes(model_dir, monkeypatch):
    """torch's intra-op pool is the process's: a version loaded with the count already set leaves it alone."""
    set_to, set_threads = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda count: (set_to.append(count), set_threads(count)))
    artifacts = load_artifacts(model_dir)
    other = 2 if torch.get_num_threads() == 1 else 1
    for threads in (other, other, 3, 3):
        assert f"CPU, {threads} threads" in TorchBackend(artifacts, "fp32", threads).description
        assert torch.get_num_threads() == threads
    assert set_to == [other, 3]


def _health(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _rest_ready(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_a_device_failure_fails_its_batch_and_turns_health_not_serving(model_dir):
    """torch's own OutOfMemoryError, raised where a CUDA allocation would raise it (the forward pass), through the
    real torch backend, batcher, server and both transports."""
    served = ServerThread(server_config(model_dir, backend="torch"))
    try:
        backend = served.server.service.backend
        request = pb.ClassifyRequest(images=[image_message(np.full((1, 28, 28), 0.5, np.float32))])
        with grpc.insecure_channel(served.target) as channel:
            stub = capsnet_pb2_grpc.CapsNetServiceStub(channel)
            assert len(stub.Classify(request, timeout=30).results) == 1 and _health(served.target) == "SERVING"

            def out_of_memory(module, inputs):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")

            hook = backend.model.register_forward_pre_hook(out_of_memory)
            with pytest.raises(grpc.RpcError) as failed:
                stub.Classify(request, timeout=30)
            assert failed.value.code() == grpc.StatusCode.INTERNAL
            assert "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" in failed.value.details()
            hook.remove()  # the device stays failed: later requests are refused, so clients retry elsewhere
            with pytest.raises(grpc.RpcError) as again:
                stub.Classify(request, timeout=30)
            assert again.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "OutOfMemoryError: CUDA out of memory" in again.value.details()
        assert isinstance(backend.failed, str) and _health(served.target) == "NOT_SERVING"
        assert _rest_ready(served.server.http_port) == 400
        body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": [1, 1, 28, 28],
                                       "data": [0.5] * 784}]}).encode()
        infer = urllib.request.Request(f"http://127.0.0.1:{served.server.http_port}/v2/models/capsnet/infer", body,
                                       {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as rest:
            urllib.request.urlopen(infer, timeout=30)
        assert rest.value.code in (500, 503)
    finally:
        served.stop()


def test_a_failed_device_raises_device_failure_at_once(model_dir):
    backend = TorchBackend(load_artifacts(model_dir), "fp32", 1)
    hook = backend.model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA oom")))
    with pytest.raises(DeviceFailure, match="OutOfMemoryError: CUDA oom"):
        backend.run(np.zeros((1, 1, 28, 28), np.float32))
    hook.remove()
    with pytest.raises(DeviceFailure, match="OutOfMemoryError: CUDA oom"):
        backend.run(np.zeros((1, 1, 28, 28), np.float32))
    assert backend.failed == "OutOfMemoryError: CUDA oom"
    plain_error = TorchBackend(load_artifacts(model_dir), "fp32", 1)
    with pytest.raises(RuntimeError):  # a caller's mistake (a wrong shape) is no device failure
        plain_error.run(np.zeros((1, 3, 28, 28), np.float32))
    assert plain_error.failed is None
