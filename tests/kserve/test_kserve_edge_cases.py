"""KServe v2 edge cases real clients hit, checked against what Triton's gRPC endpoint does.

Tensor parameters: Triton acts on shared memory (inputs and outputs) and classification (outputs), as this server
does (tests/kserve/test_kserve_shared_memory.py), and ignores any other key (server src/grpc/grpc_utils.h
ParseSharedMemoryParams, infer_handler.h ParseClassificationParams). The KServe Python SDK's
`InferRequest.to_grpc()` (kserve 0.21) puts `binary_data_size` on every input set from numpy, so a server that
refused every tensor parameter could not answer that client at all.
"""

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from kserve_messages import images, infer_request, response_arrays

BATCH = images(2, seed=21)


def kserve_sdk_request(batch: np.ndarray, outputs=()):
    """What kserve.InferenceGRPCClient sends for InferInput.set_data_from_numpy(batch): raw contents, and the input's
    parameters {"binary_data_size": <bytes>}; RequestedOutput(name, parameters={"binary_data": True}) adds that."""
    request = infer_request(batch, raw=True, id="kserve-sdk-1")
    request.inputs[0].parameters["binary_data_size"].int64_param = len(request.raw_input_contents[0])
    for name in outputs:
        request.outputs.add(name=name).parameters["binary_data"].bool_param = True
    return request


@pytest.mark.parametrize("outputs", [(), ("poses", "probabilities")])
def test_parameters_triton_ignores_are_ignored(kserve_stub, run_onnx, outputs):
    response = kserve_stub.ModelInfer(kserve_sdk_request(BATCH, outputs), timeout=30)
    arrays = response_arrays(response)
    expected = run_onnx(BATCH)
    assert response.id == "kserve-sdk-1"
    assert tuple(arrays) == (outputs or ("probabilities", "poses", "reconstruction"))
    for name, array in arrays.items():
        np.testing.assert_allclose(array, expected[name], rtol=1e-4, atol=1e-5, err_msg=name)


def shared_memory_input(request):
    request.inputs[0].parameters["shared_memory_region"].string_param = "input-region"
    request.inputs[0].parameters["shared_memory_byte_size"].int64_param = BATCH.nbytes
    request.inputs[0].parameters["binary_data_size"].int64_param = BATCH.nbytes  # ignored, not what is refused


def shared_memory_offset_alone(request):
    request.inputs[0].parameters["shared_memory_offset"].int64_param = 0


def shared_memory_output(request):
    output = request.outputs.add(name="poses")
    output.parameters["shared_memory_region"].string_param = "output-region"
    output.parameters["shared_memory_byte_size"].int64_param = 2 * 10 * 16 * 4


def classification_output(request):
    request.outputs.add(name="probabilities")
    request.outputs.add(name="poses").parameters["classification"].int64_param = 3


# Shared memory and classification used wrongly are refused, by name, whatever else comes with it.
@pytest.mark.parametrize("change, code, fragments", [
    (shared_memory_input, grpc.StatusCode.INVALID_ARGUMENT,
     ["inputs[0]: data given both in shared memory", "raw_input_contents"]),
    (shared_memory_offset_alone, grpc.StatusCode.INVALID_ARGUMENT,
     ["inputs[0].parameters: shared memory needs shared_memory_region and shared_memory_byte_size",
      "got shared_memory_offset"]),
    (shared_memory_output, grpc.StatusCode.NOT_FOUND,
     ["outputs[0].parameters.shared_memory_region: unable to find shared memory region 'output-region'"]),
    (classification_output, grpc.StatusCode.INVALID_ARGUMENT,
     ["outputs[1].parameters.classification: only 'probabilities'", "'poses' cannot be classified"]),
], ids=["shm-input-and-raw", "shm-offset-alone", "shm-output-unregistered", "classification-of-poses"])
def test_parameters_used_wrongly_are_refused(kserve_stub, change, code, fragments):
    request = infer_request(BATCH, raw=True)
    change(request)
    with pytest.raises(grpc.RpcError) as caught:
        kserve_stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == code, caught.value.details()
    for fragment in fragments:
        assert fragment in caught.value.details()


def test_tritonclient_classification_and_an_unregistered_region_and_it_carries_on(kserve_target, run_onnx):
    client = grpcclient.InferenceServerClient(url=kserve_target)
    try:
        def images_input():
            tensor = grpcclient.InferInput("images", list(BATCH.shape), "FP32")
            tensor.set_data_from_numpy(BATCH)
            return tensor

        classified = client.infer("capsnet", [images_input()],
                                  outputs=[grpcclient.InferRequestedOutput("probabilities", class_count=3)])
        probabilities = run_onnx(BATCH)["probabilities"]  # (2, 10)
        top = np.argsort(-probabilities, axis=1, kind="stable")[:, :3]
        expected = [[f"{probabilities[row, index]:f}:{index}:{index}".encode() for index in top[row]]
                    for row in range(2)]
        answered = classified.as_numpy("probabilities")
        assert answered.shape == (2, 3) and [[item.split(b":")[1:] for item in row] for row in answered.tolist()] == \
            [[item.split(b":")[1:] for item in row] for row in expected]
        scores = np.array([[float(item.split(b":")[0]) for item in row] for row in answered.tolist()])
        np.testing.assert_allclose(scores, np.take_along_axis(probabilities, top, axis=1), atol=2e-5)

        in_shared_memory = grpcclient.InferInput("images", list(BATCH.shape), "FP32")
        in_shared_memory.set_shared_memory("images-region", BATCH.nbytes)
        with pytest.raises(InferenceServerException) as error:
            client.infer("capsnet", [in_shared_memory])
        assert error.value.status() == "StatusCode.NOT_FOUND" and "'images-region'" in error.value.message()

        result = client.infer("capsnet", [images_input()], outputs=[grpcclient.InferRequestedOutput("probabilities")])
        np.testing.assert_allclose(result.as_numpy("probabilities"), probabilities, rtol=1e-4, atol=1e-5)
    finally:
        client.close()
