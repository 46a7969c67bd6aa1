"""An EM-routing model served by the same server: class activations as probabilities, the 4×4 class poses
flattened to 16, through the CapsNet API and KServe v2 with no client change."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from serving_helpers import ServerThread, server_config

from capsnet.client.api import CapsNetClient
from capsnet.kserve import grpc_service_pb2 as kserve_pb
from capsnet.kserve import grpc_service_pb2_grpc as kserve_grpc
from capsnet.models.checkpoint import load_checkpoint
from capsnet.training.data import load_embedded, to_float
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    test = load_embedded().test
    return to_float(test.images[np.arange(0, len(test), 100)]).numpy()  # (10, 1, 28, 28): every class


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_em_model_served_equals_its_checkpoint(em_tiny_export, trained_em_tiny_checkpoint, digits, backend):
    model = load_checkpoint(trained_em_tiny_checkpoint).build_model()
    with torch.inference_mode():
        expected = model(torch.from_numpy(digits))
    server = ServerThread(server_config(em_tiny_export, backend=backend, max_batch_size=16))
    try:
        with grpc.insecure_channel(server.target) as channel:
            info = capsnet_pb2_grpc.CapsNetServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert (info.routing.variant, info.routing.iterations, info.pose_dim) == ("em", 2, 16)  # em-tiny
        with CapsNetClient(server.target) as client:
            predictions = client.classify(list(digits), reconstruction=True)
    finally:
        server.stop()
    probabilities = np.stack([p.probabilities for p in predictions])  # (10, 10)
    np.testing.assert_allclose(probabilities, expected.probabilities.numpy(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.stack([p.poses for p in predictions]), expected.poses.numpy(), rtol=0, atol=1e-4)
    assert [p.class_index for p in predictions] == expected.probabilities.argmax(dim=1).tolist()
    assert all(p.reconstruction.shape == (1, 28, 28) for p in predictions)


def test_em_model_over_kserve_v2(em_tiny_export, trained_em_tiny_checkpoint, digits):
    model = load_checkpoint(trained_em_tiny_checkpoint).build_model()
    with torch.inference_mode():
        expected = model(torch.from_numpy(digits[:3])).probabilities.numpy()
    server = ServerThread(server_config(em_tiny_export))
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            request = kserve_pb.ModelInferRequest(
                model_name="capsnet",
                inputs=[kserve_pb.ModelInferRequest.InferInputTensor(name="images", datatype="FP32",
                                                                      shape=[3, 1, 28, 28])],
                outputs=[kserve_pb.ModelInferRequest.InferRequestedOutputTensor(name="probabilities")],
                raw_input_contents=[np.ascontiguousarray(digits[:3]).tobytes()],
            )
            response = stub.ModelInfer(request, timeout=30)
    finally:
        server.stop()
    (output,) = response.outputs
    assert output.name == "probabilities" and list(output.shape) == [3, 10]
    got = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(3, 10)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)
