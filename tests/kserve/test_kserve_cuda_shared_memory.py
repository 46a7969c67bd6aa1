"""Triton's CUDA shared memory on a GPU engine (the torch backend on device 0), driven by tritonclient's
cuda_shared_memory utilities unchanged, in a client process of its own: a cudaIPC handle opens only in another
process. Answers are compared with ONNX Runtime's on the CPU. On a CPU-only server the register call is refused
(test_kserve_shared_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kserve_messages import images

pytestmark = pytest.mark.gpu

# The client: input and probabilities in CUDA regions of device 0, poses in the answer; then what the server refuses.
CLIENT = r"""
import json, sys, urllib.request
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm
from tritonclient.utils import InferenceServerException

target, http_target, batch_path = sys.argv[1:4]
batch = np.load(batch_path)
client = grpcclient.InferenceServerClient(target)
client.unregister_cuda_shared_memory()
size = len(batch) * 10 * 4
inputs = cudashm.create_shared_memory_region("in", batch.nbytes, 0)
cudashm.set_shared_memory_region(inputs, [batch])
outputs = cudashm.create_shared_memory_region("out", size, 0)
client.register_cuda_shared_memory("in", cudashm.get_raw_handle(inputs), 0, batch.nbytes)
client.register_cuda_shared_memory("out", cudashm.get_raw_handle(outputs), 0, size)
tensor = grpcclient.InferInput("images", list(batch.shape), "FP32")
tensor.set_shared_memory("in", batch.nbytes)
probabilities = grpcclient.InferRequestedOutput("probabilities")
probabilities.set_shared_memory("out", size)
result = client.infer("capsnet", [tensor], outputs=[probabilities, grpcclient.InferRequestedOutput("poses")])
answer = {"status": client.get_cuda_shared_memory_status(as_json=True),
          "extensions": client.get_server_metadata(as_json=True)["extensions"],
          "probabilities": cudashm.get_contents_as_numpy(outputs, np.float32, [len(batch), 10]).tolist(),
          "poses": result.as_numpy("poses").tolist()}
try:  # more bytes than the client allocated
    client.register_cuda_shared_memory("big", cudashm.get_raw_handle(inputs), 0, batch.nbytes + 2 ** 30)
    answer["too_large"] = "registered"
except InferenceServerException as err:
    answer["too_large"] = [err.status(), err.message()]
# REST's route, as tritonclient.http calls it (that client needs gevent, which this machine may lack)
body = {"raw_handle": {"b64": cudashm.get_raw_handle(inputs).decode()}, "device_id": 0, "byte_size": batch.nbytes}
urllib.request.urlopen(urllib.request.Request(f"http://{http_target}/v2/cudasharedmemory/region/in-rest/register",
                                              data=json.dumps(body).encode(), method="POST"), timeout=30).read()
with urllib.request.urlopen(f"http://{http_target}/v2/cudasharedmemory/status", timeout=30) as status:
    answer["rest_status"] = json.loads(status.read())
client.unregister_cuda_shared_memory()
answer["after"] = client.get_cuda_shared_memory_status(as_json=True)
for handle in (inputs, outputs):
    cudashm.destroy_shared_memory_region(handle)
print(json.dumps(answer))
"""


@pytest.fixture(scope="module")
def gpu_server(kserve_model_dir):
    from serving_helpers import ServerThread, server_config

    running = ServerThread(server_config(kserve_model_dir, backend="torch", gpu=0, precision="fp32", max_batch_size=8))
    yield running
    running.stop()


def run_client(gpu_server, batch: np.ndarray, tmp_path) -> dict:
    np.save(tmp_path / "batch.npy", batch)
    completed = subprocess.run([sys.executable, "-c", CLIENT, gpu_server.target,
                                f"127.0.0.1:{gpu_server.server.http_port}", str(tmp_path / "batch.npy")],
                               capture_output=True, text=True, timeout=180)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def check_answer(answer: dict, batch: np.ndarray, run_onnx) -> None:
    expected = run_onnx(batch)
    np.testing.assert_allclose(answer["probabilities"], expected["probabilities"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(answer["poses"], expected["poses"], rtol=1e-4, atol=1e-4)
    assert "cuda_shared_memory" in answer["extensions"] and "system_shared_memory" in answer["extensions"]
    regions = answer["status"]["regions"]  # as JSON: a field at its default (device 0) is left out
    assert {name: (int(region.get("device_id", 0)), int(region["byte_size"])) for name, region in regions.items()} == {
        "in": (0, batch.nbytes), "out": (0, len(batch) * 10 * 4)}
    assert answer["too_large"][0] == "StatusCode.INVALID_ARGUMENT" and answer["too_large"][1].startswith("byte_size:")
    assert [region["name"] for region in answer["rest_status"]] == ["in", "out", "in-rest"]
    assert answer["after"] == {}


def test_cuda_shared_memory_round_trip(gpu_server, run_onnx, tmp_path):
    batch = images(4, seed=41)
    check_answer(run_client(gpu_server, batch, tmp_path), batch, run_onnx)


def test_cuda_shared_memory_goes_device_to_device_into_the_gpu_engine(gpu_server, run_onnx, tmp_path):
    """The GPU engine takes device input (cuda_ipc.DeviceInput): the client's images reach it as a CUDA batch."""
    import torch

    backend = gpu_server.server.service.backend
    seen = []
    engine_run_device = backend.run_device

    def run_device(batch: torch.Tensor) -> dict[str, torch.Tensor]:
        seen.append((batch.device.type, tuple(batch.shape)))
        return engine_run_device(batch)

    backend.run_device = run_device
    try:
        batch = images(3, seed=42)
        check_answer(run_client(gpu_server, batch, tmp_path), batch, run_onnx)
    finally:
        del backend.run_device
    assert seen == [("cuda", (3, 1, 28, 28))]
