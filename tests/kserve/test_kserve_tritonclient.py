"""tritonclient.grpc, the newest release, unchanged, in this very process against our server: live/ready/
metadata/infer. Both define the protobuf package `inference`; ours lives in a pool of its own, so they coexist."""

import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from capsnet import __version__
from capsnet.kserve import grpc_service_pb2
from kserve_messages import CPU_EXTENSIONS, images

# The order that failed with "duplicate symbol 'inference.ServerLiveRequest'": tritonclient first, then ours.
BOTH_IN_ONE_PROCESS = """
import tritonclient.grpc.service_pb2 as theirs
import capsnet.kserve.grpc_service_pb2 as ours
assert theirs.ModelInferRequest is not ours.ModelInferRequest
# the same wire format both ways
request = ours.ModelInferRequest(model_name="capsnet", id="x")
assert theirs.ModelInferRequest.FromString(request.SerializeToString()).model_name == "capsnet"
print(ours.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name)
"""


def test_tritonclient_and_our_generated_code_import_in_either_order():
    completed = subprocess.run([sys.executable, "-c", BOTH_IN_ONE_PROCESS], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "inference.GRPCInferenceService"


@pytest.fixture
def triton(kserve_target):
    client = grpcclient.InferenceServerClient(url=kserve_target)
    yield client
    client.close()


def test_tritonclient_live_ready_metadata_and_infer(triton, run_onnx):
    assert grpc_service_pb2.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"  # ours, loaded too
    assert (triton.is_server_live(), triton.is_server_ready(), triton.is_model_ready("capsnet")) == (True, True, True)
    assert triton.get_server_metadata(as_json=True) == {"name": "capsnet-serve", "version": __version__,
                                                        "extensions": CPU_EXTENSIONS}
    metadata = triton.get_model_metadata("capsnet", as_json=True)
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == ("capsnet", ["1"], "onnxruntime_onnx")
    assert metadata["inputs"] == [{"name": "images", "datatype": "FP32", "shape": ["-1", "1", "28", "28"]}]
    assert [output["name"] for output in metadata["outputs"]] == ["probabilities", "poses", "reconstruction"]

    batch = images(4, seed=11)  # (4, 1, 28, 28)
    images_input = grpcclient.InferInput("images", list(batch.shape), "FP32")
    images_input.set_data_from_numpy(batch)
    requested = [grpcclient.InferRequestedOutput("poses"), grpcclient.InferRequestedOutput("probabilities")]
    result = triton.infer("capsnet", [images_input], outputs=requested, request_id="triton-1", client_timeout=30)
    response = result.get_response()
    assert (response.id, response.model_name, response.model_version) == ("triton-1", "capsnet", "1")
    assert [output.name for output in response.outputs] == ["poses", "probabilities"]
    expected = run_onnx(batch)
    for name in ("probabilities", "poses"):
        np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-4, atol=1e-5)


def test_tritonclient_unknown_model_is_not_found(triton):
    with pytest.raises(InferenceServerException) as error:
        triton.is_model_ready("no-such-model")
    assert error.value.status() == "StatusCode.NOT_FOUND" and "'no-such-model'" in error.value.message()
