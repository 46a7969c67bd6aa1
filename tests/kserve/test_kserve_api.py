"""KServe v2 with our generated stubs: live/ready/metadata, and inference (raw, typed, UINT8) equal to ONNX Runtime."""

import threading

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from kserve_messages import CPU_EXTENSIONS, images, infer_request, response_arrays

from capsnet import __version__
from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.serving.transports import kserve_grpc

# matches the onnxruntime backend run on different batch compositions, not bit-for-bit
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def signature(tensors) -> list[tuple]:
    return [(tensor.name, tensor.datatype, list(tensor.shape)) for tensor in tensors]


def test_reflection_describes_the_service_as_grpcurl_sees_it(kserve_target):
    with grpc.insecure_channel(kserve_target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "inference.GRPCInferenceService" in database.get_services()
        service = descriptor_pool.DescriptorPool(database).FindServiceByName("inference.GRPCInferenceService")
        infer = service.methods_by_name["ModelInfer"]
        assert [method.name for method in service.methods] == [
            "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelConfig",
                "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
                "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"]
        assert infer.input_type.fields_by_name["raw_input_contents"].number == 7


def test_live_and_ready(kserve_stub):
    assert kserve_stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
    assert kserve_stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
    assert kserve_stub.ModelReady(pb.ModelReadyRequest(name="capsnet"), timeout=10).ready
    assert kserve_stub.ModelReady(pb.ModelReadyRequest(name="capsnet", version="1"), timeout=10).ready


def test_server_metadata(kserve_stub):
    metadata = kserve_stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10)
    assert (metadata.name, metadata.version, list(metadata.extensions)) == ("capsnet-serve", __version__,
                                                                            CPU_EXTENSIONS)


def test_model_metadata(kserve_stub):
    metadata = kserve_stub.ModelMetadata(pb.ModelMetadataRequest(name="capsnet"), timeout=10)
    assert (metadata.name, list(metadata.versions)) == ("capsnet", ["1"])
    assert metadata.platform == "onnxruntime_onnx"
    assert signature(metadata.inputs) == [("images", "FP32", [-1, 1, 28, 28])]
    assert signature(metadata.outputs) == [("probabilities", "FP32", [-1, 10]), ("poses", "FP32", [-1, 10, 16]),
                                         ("reconstruction", "FP32", [-1, 784])]


def test_infer_raw_answers_raw_and_equals_onnxruntime(kserve_stub, run_onnx):
    batch = images(3, seed=1)
    response = kserve_stub.ModelInfer(infer_request(batch, raw=True, id="req-42"), timeout=30)
    assert (response.model_name, response.model_version, response.id) == ("capsnet", "1", "req-42")
    assert len(response.raw_output_contents) == 3 and not response.outputs[0].HasField("contents")
    arrays = response_arrays(response)
    expected = run_onnx(batch)
    assert list(arrays) == ["probabilities", "poses", "reconstruction"]  # none asked: all, in model order
    for name, array in arrays.items():
        np.testing.assert_allclose(array, expected[name], **TOLERANCE, err_msg=name)


# 2 images are converted on the event loop, 8 (6272 values, over INLINE_TYPED_VALUES) in a worker thread.
@pytest.mark.parametrize("outputs, count", [(("poses",), 2), (("reconstruction", "probabilities"), 8)])
def test_infer_typed_answers_typed_subset_in_request_order(kserve_stub, run_onnx, outputs, count):
    batch = images(count, seed=2)
    response = kserve_stub.ModelInfer(infer_request(batch, raw=False, outputs=outputs), timeout=30)
    assert not response.raw_output_contents and response.id == ""
    arrays = response_arrays(response)
    expected = run_onnx(batch)
    assert tuple(arrays) == outputs
    for name, array in arrays.items():
        np.testing.assert_allclose(array, expected[name], **TOLERANCE, err_msg=name)


@pytest.mark.parametrize("count, on_the_event_loop", [(2, True), (8, False)])
def test_large_typed_contents_are_converted_off_the_event_loop(kserve_stub, monkeypatch, count, on_the_event_loop):
    """Converting thousands of typed values holds the thread that does it: not the loop every RPC shares."""
    threads = []
    convert = kserve_grpc._input_values

    def recording(*args):
        threads.append(threading.current_thread().name)
        return convert(*args)

    monkeypatch.setattr(kserve_grpc, "_input_values", recording)
    kserve_stub.ModelInfer(infer_request(images(count, seed=4), raw=False, outputs=("probabilities",)), timeout=30)
    assert len(threads) == 1 and (threads[0] == "kserve-test-server") is on_the_event_loop, threads


@pytest.mark.parametrize("raw", [True, False])
def test_infer_uint8_is_scaled_to_unit_range(kserve_stub, run_onnx, raw):
    pixels = np.random.default_rng(3).integers(0, 256, size=(2, 1, 28, 28), dtype=np.uint8)
    request = pb.ModelInferRequest(model_name="capsnet", model_version="1")
    tensor = request.inputs.add(name="images", datatype="UINT8", shape=pixels.shape)
    if raw:
        request.raw_input_contents.append(pixels.tobytes())
    else:
        tensor.contents.uint_contents.extend(pixels.ravel().tolist())
    request.outputs.add(name="probabilities")
    arrays = response_arrays(kserve_stub.ModelInfer(request, timeout=30))
    expected = run_onnx(pixels.astype(np.float32) / 255)
    np.testing.assert_allclose(arrays["probabilities"], expected["probabilities"], **TOLERANCE)
