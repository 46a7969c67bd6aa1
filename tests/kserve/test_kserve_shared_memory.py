"""Triton's shared-memory and classification extensions, driven by tritonclient unchanged (its shared_memory utilities
make the POSIX objects), over gRPC and REST; and what the server refuses, with Triton's codes, naming the field."""

from __future__ import annotations

import base64
import itertools
import os
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from kserve_messages import CPU_EXTENSIONS, MAX_BATCH_SIZE, images, infer_request
from tritonclient.utils import InferenceServerException

from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import grpc_service_pb2_grpc as pb_grpc
from capsnet.serving.engine.backend_registry import BACKEND_KINDS, takes_cuda_shared_memory

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
_keys = itertools.count()


@pytest.fixture
def regions():
    """make(name, byte_size) -> a tritonclient shared-memory handle under a fresh POSIX key; all destroyed after."""
    made = []

    def make(name: str, byte_size: int):
        key = f"/capsnet-test-{os.getpid()}-{next(_keys)}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return handle, key

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.fixture(scope="module")
def rest_and_grpc(kserve_rest):
    """(tritonclient.http, tritonclient.grpc) clients of the module's server."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{kserve_rest.server.http_port}")
    rpc = grpcclient.InferenceServerClient(kserve_rest.target)
    yield http, rpc
    http.close()
    rpc.close()


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_tensors_in_and_out_of_system_shared_memory_as_tritonclient_passes_them(rest_and_grpc, regions, run_onnx,
                                                                                transport):
    client, module = (rest_and_grpc[0], httpclient) if transport == "http" else (rest_and_grpc[1], grpcclient)
    client.unregister_system_shared_memory()
    batch = images(4, seed=31)  # (4, 1, 28, 28)
    offset = 64  # the input after other data in the same object
    inputs_handle, inputs_key = regions("in", offset + batch.nbytes)
    outputs_handle, outputs_key = regions("out", 4 * 10 * 4 + 4 * 10 * 16 * 4)
    shm.set_shared_memory_region(inputs_handle, [batch], offset=offset)
    client.register_system_shared_memory("in", inputs_key, batch.nbytes, offset=offset)
    client.register_system_shared_memory("out", outputs_key, 4 * 10 * 4 + 4 * 10 * 16 * 4)
    status = client.get_system_shared_memory_status(**({"as_json": True} if transport == "grpc" else {}))
    regions_status = status["regions"] if transport == "grpc" else {region["name"]: region for region in status}
    assert regions_status["in"]["key"] == inputs_key and int(regions_status["in"]["offset"]) == offset
    assert int(regions_status["in"]["byte_size"]) == batch.nbytes

    tensor = module.InferInput("images", list(batch.shape), "FP32")
    tensor.set_shared_memory("in", batch.nbytes)
    probabilities, poses = module.InferRequestedOutput("probabilities"), module.InferRequestedOutput("poses")
    probabilities.set_shared_memory("out", 4 * 10 * 4)
    poses.set_shared_memory("out", 4 * 10 * 16 * 4, offset=4 * 10 * 4)
    result = client.infer("capsnet", [tensor],
                          outputs=[probabilities, poses, module.InferRequestedOutput("reconstruction")])

    expected = run_onnx(batch)
    answered = result.get_output("probabilities")  # in the region, not in the answer
    if transport == "http":
        assert "data" not in answered and "binary_data_size" not in answered.get("parameters", {})
    else:  # an empty raw entry keeps the others where tritonclient looks for them
        assert not answered.HasField("contents") and result.get_response().raw_output_contents[0] == b""
    np.testing.assert_allclose(shm.get_contents_as_numpy(outputs_handle, np.float32, [4, 10]),
                               expected["probabilities"], **TOLERANCE)
    np.testing.assert_allclose(shm.get_contents_as_numpy(outputs_handle, np.float32, [4, 10, 16], offset=4 * 10 * 4),
                               expected["poses"], **TOLERANCE)
    np.testing.assert_allclose(result.as_numpy("reconstruction"), expected["reconstruction"], **TOLERANCE)

    client.unregister_system_shared_memory("in")
    remaining = client.get_system_shared_memory_status(**({"as_json": True} if transport == "grpc" else {}))
    assert [region["name"]
            for region in (remaining.get("regions", {}).values() if transport == "grpc" else remaining)] == ["out"]
    client.unregister_system_shared_memory()  # empty name: all


def test_uint8_pixels_from_shared_memory_classified(rest_and_grpc, regions, run_onnx):
    _http, rpc = rest_and_grpc
    pixels = (images(3, seed=32) * 255).astype(np.uint8)  # (3, 1, 28, 28)
    handle, key = regions("pixels", pixels.nbytes)
    shm.set_shared_memory_region(handle, [pixels])
    rpc.register_system_shared_memory("pixels", key, pixels.nbytes)
    try:
        tensor = grpcclient.InferInput("images", list(pixels.shape), "UINT8")
        tensor.set_shared_memory("pixels", pixels.nbytes)
        result = rpc.infer("capsnet", [tensor],
                           outputs=[grpcclient.InferRequestedOutput("probabilities", class_count=2)])
        answered = result.get_output("probabilities")
        assert (answered.datatype, list(answered.shape)) == ("BYTES", [3, 2])
        classes = result.as_numpy("probabilities")
        probabilities = run_onnx(pixels.astype(np.float32) / np.float32(255))["probabilities"]
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, :2]
        assert [[int(item.split(b":")[1]) for item in row] for row in classes.tolist()] == order.tolist()
    finally:
        rpc.unregister_system_shared_memory()


def test_classification_over_rest_in_json_and_in_binary(rest_and_grpc, run_onnx):
    http, _ = rest_and_grpc
    batch = images(2, seed=33)
    probabilities = run_onnx(batch)["probabilities"]  # (2, 10)
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :3]
    for binary in (False, True):
        tensor = httpclient.InferInput("images", list(batch.shape), "FP32")
        tensor.set_data_from_numpy(batch)
        result = http.infer("capsnet", [tensor], outputs=[
            httpclient.InferRequestedOutput("probabilities", binary_data=binary, class_count=3)])
        answered = result.as_numpy("probabilities")
        assert answered.shape == (2, 3), binary
        parts = [[item.decode() if isinstance(item, bytes) else item for item in row] for row in answered.tolist()]
        assert [[int(item.split(":")[1]) for item in row] for row in parts] == order.tolist()
        assert all(item.split(":")[2] == item.split(":")[1] for row in parts for item in row)  # the digits' names
        np.testing.assert_allclose([[float(item.split(":")[0]) for item in row] for row in parts],
                                   np.take_along_axis(probabilities, order, axis=1), atol=2e-5)


def test_server_metadata_lists_the_extensions_served(rest_and_grpc):
    http, rpc = rest_and_grpc
    assert http.get_server_metadata()["extensions"] == CPU_EXTENSIONS
    assert rpc.get_server_metadata(as_json=True)["extensions"] == CPU_EXTENSIONS
    assert "cuda_shared_memory" not in CPU_EXTENSIONS  # no GPU engine serves on this host's test server


@pytest.mark.parametrize("name", BACKEND_KINDS)
@pytest.mark.parametrize("on_gpu", [True, False], ids=["gpu", "cpu"])
def test_cuda_shared_memory_is_taken_by_the_gpu_engines_on_a_gpu(name, on_gpu):
    """What the registry's rows say decides the cuda_shared_memory extension: the torch, AOTInductor, fused and
    TensorRT engines on a GPU; never a backend on the CPU, nor ONNX Runtime's GPU providers (nor OpenVINO, a CPU
    engine here)."""
    backend = SimpleNamespace(name=name, on_gpu=on_gpu)
    assert takes_cuda_shared_memory(backend) is (on_gpu and name not in ("onnxruntime", "openvino"))  # type: ignore[arg-type]


def _code(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value.status(), caught.value.message()


def test_registering_refuses_what_is_not_a_shared_memory_object(rest_and_grpc, regions, tmp_path):
    http, rpc = rest_and_grpc
    _handle, key = regions("small", 100)
    outside = tmp_path / "file"
    outside.write_bytes(b"x" * 100)
    for bad_key in ("no-slash", "/a/b", str(outside), "/../../etc/passwd", "/..", "/.", "/" + "x" * 300, ""):
        status, message = _code(lambda bad_key=bad_key: rpc.register_system_shared_memory("r", bad_key, 10))
        assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith("key: expected a POSIX shared-memory"), \
            (bad_key, message)
    status, message = _code(lambda: rpc.register_system_shared_memory("r", f"/capsnet-absent-{os.getpid()}", 10))
    assert status == "StatusCode.INTERNAL" and "unable to open shared memory region" in message
    status, message = _code(lambda: rpc.register_system_shared_memory("r", key, 80, offset=40))
    assert status == "StatusCode.INVALID_ARGUMENT" and message.startswith("byte_size:") and "(100 bytes)" in message
    rpc.register_system_shared_memory("r", key, 100)
    try:
        status, message = _code(lambda: rpc.register_system_shared_memory("r", key, 100))
        assert status == "StatusCode.ALREADY_EXISTS" and "'r' already in manager" in message
        with pytest.raises(InferenceServerException) as caught:  # REST: 409, its JSON error
            http.register_system_shared_memory("r", key, 100)
        assert "already in manager" in caught.value.message()
        status, message = _code(lambda: rpc.get_system_shared_memory_status("nothing"))
        assert status == "StatusCode.NOT_FOUND" and "'nothing'" in message
        status, message = _code(lambda: rpc.get_cuda_shared_memory_status("r"))
        assert status == "StatusCode.NOT_FOUND" and "registered as system shared memory" in message
    finally:
        rpc.unregister_system_shared_memory("r")


def test_a_cpu_server_refuses_cuda_shared_memory_in_one_line(kserve_rest):
    with grpc.insecure_channel(kserve_rest.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(
                name="gpu", raw_handle=bytes(64), device_id=0, byte_size=1024), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("failed to register CUDA shared memory region: 'gpu', GPUs not supported")
    assert "\n" not in caught.value.details()
    http = httpclient.InferenceServerClient(f"127.0.0.1:{kserve_rest.server.http_port}")
    try:
        status, message = _code(lambda: http.register_cuda_shared_memory("gpu", base64.b64encode(bytes(64)), 0, 1024))
        assert status == "400" and message.startswith("failed to register CUDA shared memory region: 'gpu', GPUs not")
    finally:
        http.close()


def test_tensors_that_do_not_fit_their_region_are_refused_by_field(kserve_rest, regions):
    batch = images(2, seed=34)
    handle, key = regions("in", batch.nbytes)
    shm.set_shared_memory_region(handle, [batch])
    with grpc.insecure_channel(kserve_rest.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(name="in", key=key,
                                                                             byte_size=batch.nbytes), timeout=10)
        try:
            def call(size=batch.nbytes, offset=None, output=None):
                request = infer_request(batch, raw=True)
                del request.raw_input_contents[:]
                request.inputs[0].parameters["shared_memory_region"].string_param = "in"
                request.inputs[0].parameters["shared_memory_byte_size"].int64_param = size
                if offset is not None:
                    request.inputs[0].parameters["shared_memory_offset"].int64_param = offset
                if output is not None:
                    out = request.outputs.add(name="poses")
                    out.parameters["shared_memory_region"].string_param = "in"
                    out.parameters["shared_memory_byte_size"].int64_param = output
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ModelInfer(request, timeout=30)
                return caught.value.code(), caught.value.details()

            invalid = grpc.StatusCode.INVALID_ARGUMENT
            assert call(size=batch.nbytes - 4) == (invalid, "inputs[0].parameters.shared_memory_byte_size: expected "
                                                            f"{batch.nbytes} bytes for FP32 shape [2, 1, 28, 28], got "
                                                            f"{batch.nbytes - 4}")
            assert call(offset=batch.nbytes) == (invalid, f"inputs[0].parameters.shared_memory_offset: {batch.nbytes} "
                                                          f"is outside region 'in' ({batch.nbytes} bytes)")
            code, details = call(offset=4)
            assert code == invalid and details.startswith("inputs[0].parameters.shared_memory_byte_size: offset 4 + ")
            code, details = call(output=100)
            assert code == invalid and details == ("outputs[0].parameters.shared_memory_byte_size: 100 bytes cannot "
                                                   "hold the output of shape [2, 10, 16] (1280 bytes)")
            request = infer_request(batch, raw=True)  # and it carries on
            assert len(stub.ModelInfer(request, timeout=30).raw_output_contents) == 3
        finally:
            stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), timeout=10)


def test_limits_and_the_switch_that_turns_client_shared_memory_off(start_kserve, regions):
    _handle, key = regions("any", 64)
    limited = grpcclient.InferenceServerClient(start_kserve(max_shm_regions=2, max_shm_bytes=100))
    off = grpcclient.InferenceServerClient(start_kserve(allow_client_shm=False))
    try:
        limited.register_system_shared_memory("a", key, 40)
        status, message = _code(lambda: limited.register_system_shared_memory("b", key, 64))
        assert status == "StatusCode.RESOURCE_EXHAUSTED" and message.startswith("byte_size:") \
            and "--max-shm-bytes 100" in message
        limited.register_system_shared_memory("b", key, 60)
        status, message = _code(lambda: limited.register_system_shared_memory("c", key, 1))
        assert status == "StatusCode.RESOURCE_EXHAUSTED" and "--max-shm-regions 2" in message
        status, message = _code(lambda: off.register_system_shared_memory("a", key, 40))
        assert status == "StatusCode.PERMISSION_DENIED" and "--no-allow-client-shm" in message
        assert "system_shared_memory" not in off.get_server_metadata(as_json=True)["extensions"]
    finally:
        limited.close()
        off.close()


def _shared_request(name: str, count: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="capsnet")
    tensor = request.inputs.add(name="images", datatype="FP32", shape=[count, 1, 28, 28])
    tensor.parameters["shared_memory_region"].string_param = name
    tensor.parameters["shared_memory_byte_size"].int64_param = count * 28 * 28 * 4
    request.outputs.add(name="probabilities")
    return request


def test_a_region_unregistered_or_shrunk_while_requests_use_it(kserve_model_dir, regions, run_onnx):
    """Requests queued behind a slow batch hold their regions: one whose region is unregistered, and the name
    registered again over other data, still reads its own images; one whose input's or output's object is cut to
    nothing is refused; the server carries on."""
    from serving_helpers import ServerThread, server_config, slow_down

    running = ServerThread(server_config(kserve_model_dir, backend="onnxruntime", max_batch_size=MAX_BATCH_SIZE))
    slow_down(running.server.service.backend, 0.5)
    first, second = images(2, seed=35), images(2, seed=36)
    first_handle, first_key = regions("a", first.nbytes)
    second_handle, second_key = regions("b", second.nbytes)
    cut_handle, cut_key = regions("cut", first.nbytes)
    _out_handle, out_key = regions("cut-out", 2 * 10 * 4)
    for handle, data in ((first_handle, first), (second_handle, second), (cut_handle, first)):
        shm.set_shared_memory_region(handle, [data])
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            register = stub.SystemSharedMemoryRegister
            register(pb.SystemSharedMemoryRegisterRequest(name="images", key=first_key, byte_size=first.nbytes))
            register(pb.SystemSharedMemoryRegisterRequest(name="cut", key=cut_key, byte_size=first.nbytes))
            register(pb.SystemSharedMemoryRegisterRequest(name="cut-out", key=out_key, byte_size=2 * 10 * 4))
            busy = stub.ModelInfer.future(infer_request(images(MAX_BATCH_SIZE, seed=37), raw=True), timeout=30)
            time.sleep(0.2)  # the backend is busy with it: the next requests queue
            held = stub.ModelInfer.future(_shared_request("images", 2), timeout=30)
            cut = stub.ModelInfer.future(_shared_request("cut", 2), timeout=30)
            into_cut = infer_request(first, raw=True)
            out = into_cut.outputs.add(name="probabilities")
            out.parameters["shared_memory_region"].string_param = "cut-out"
            out.parameters["shared_memory_byte_size"].int64_param = 2 * 10 * 4
            into_cut = stub.ModelInfer.future(into_cut, timeout=30)
            time.sleep(0.1)
            stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="images"))
            register(pb.SystemSharedMemoryRegisterRequest(name="images", key=second_key, byte_size=second.nbytes))
            os.truncate(f"/dev/shm/{cut_key[1:]}", 0)  # its client cuts the object while the request waits
            os.truncate(f"/dev/shm/{out_key[1:]}", 0)
            after = stub.ModelInfer.future(_shared_request("images", 2), timeout=30)

            busy.result()
            np.testing.assert_allclose(np.frombuffer(held.result().raw_output_contents[0], "<f4").reshape(2, 10),
                                       run_onnx(first)["probabilities"], **TOLERANCE)
            with pytest.raises(grpc.RpcError) as caught:
                cut.result()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "was made smaller after it was registered" in caught.value.details()
            with pytest.raises(grpc.RpcError) as caught:
                into_cut.result()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith("outputs[0]: region 'cut-out' cannot take 80 bytes")
            np.testing.assert_allclose(np.frombuffer(after.result().raw_output_contents[0], "<f4").reshape(2, 10),
                                       run_onnx(second)["probabilities"], **TOLERANCE)
            stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest())
    finally:
        running.stop()



def test_classification_strings_as_triton_writes_them():
    from capsnet.serving.protocol.kserve import classify, serialize_bytes

    scores = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], dtype=np.float32)  # (2, 3)
    assert classify(scores, 2, ("zero", "one", "two")).tolist() == [[b"0.700000:1:one", b"0.200000:2:two"],
                                                                  [b"0.500000:0:zero", b"0.250000:1:one"]]
    assert classify(scores, 5, None).tolist() == [[b"0.700000:1", b"0.200000:2", b"0.100000:0"],  # index alone
                                                  [b"0.500000:0", b"0.250000:1", b"0.250000:2"]]  # ties: lower first
    assert serialize_bytes(np.array([b"ab", b""], dtype=object)) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
