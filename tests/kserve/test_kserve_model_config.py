"""Triton's ModelConfig RPC, with real clients against real servers: tritonclient's get_model_config, our generated
stub, errors, and perf_analyzer (which asks ModelConfig before it sends a request) when it is here."""

import json
import os
import re
import shutil
import subprocess

import grpc
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as triton_config_pb2
from tritonclient.utils import InferenceServerException

from capsnet.kserve import grpc_service_pb2 as pb
from capsnet.kserve import model_config_pb2 as config_pb
from kserve_messages import MAX_BATCH_SIZE, images

# What Triton answers for this model served by it with dynamic batching: tensors without the batch axis.
EXPECTED_INPUTS = [{"name": "images", "data_type": "TYPE_FP32", "dims": ["1", "28", "28"]}]
EXPECTED_OUTPUTS = [
    {"name": "probabilities", "data_type": "TYPE_FP32", "dims": ["10"]},
    {"name": "poses", "data_type": "TYPE_FP32", "dims": ["10", "16"]},
    {"name": "reconstruction", "data_type": "TYPE_FP32", "dims": ["784"]},
]
# The class names, in the parameters Triton keeps for free-form settings: the digits, as JSON
EXPECTED_PARAMETERS = {"class_names": {"string_value": json.dumps([str(digit) for digit in range(10)])}}


@pytest.fixture
def triton(kserve_target):
    client = grpcclient.InferenceServerClient(url=kserve_target)
    yield client
    client.close()


def test_tritonclient_get_model_config_as_json(triton):
    config = triton.get_model_config("capsnet", as_json=True)["config"]
    # MessageToJson leaves out defaults: the server's max_queue_delay_us of 0 makes dynamic_batching {}.
    assert config == {"name": "capsnet", "platform": "onnxruntime_onnx", "max_batch_size": MAX_BATCH_SIZE,
                      "input": EXPECTED_INPUTS, "output": EXPECTED_OUTPUTS, "dynamic_batching": {},
                      "parameters": EXPECTED_PARAMETERS}
    assert triton.get_model_config("capsnet", "1", as_json=True)["config"] == config


def test_tritonclient_get_model_config_message(triton):
    response = triton.get_model_config("capsnet")
    assert isinstance(response.config, triton_config_pb2.ModelConfig)  # read with Triton's complete schema
    config = response.config
    assert (config.name, config.platform, config.max_batch_size) == ("capsnet", "onnxruntime_onnx", MAX_BATCH_SIZE)
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert config.dynamic_batching.max_queue_delay_microseconds == 0
    assert [(tensor.name, tensor.data_type, list(tensor.dims)) for tensor in config.input] == [
        ("images", triton_config_pb2.TYPE_FP32, [1, 28, 28])]
    assert json.loads(config.parameters["class_names"].string_value) == [str(digit) for digit in range(10)]


def test_the_config_follows_the_servers_settings(start_kserve):
    target = start_kserve(max_batch_size=4, max_queue_delay_us=250)
    client = grpcclient.InferenceServerClient(url=target)
    try:
        config = client.get_model_config("capsnet", as_json=True)["config"]
    finally:
        client.close()
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": "250"}  # uint64: a JSON string
    assert (config["input"], config["output"]) == (EXPECTED_INPUTS, EXPECTED_OUTPUTS)


def test_our_stub(kserve_stub):
    for version in ("", "1"):
        config = kserve_stub.ModelConfig(pb.ModelConfigRequest(name="capsnet", version=version), timeout=10).config
        assert (config.name, config.platform, config.max_batch_size) == ("capsnet", "onnxruntime_onnx", MAX_BATCH_SIZE)
        assert [(tensor.name, tensor.data_type, list(tensor.dims)) for tensor in config.input] == [
            ("images", config_pb.TYPE_FP32, [1, 28, 28])]
        assert [(tensor.name, tensor.data_type, list(tensor.dims)) for tensor in config.output] == [
            ("probabilities", config_pb.TYPE_FP32, [10]), ("poses", config_pb.TYPE_FP32, [10, 16]),
            ("reconstruction", config_pb.TYPE_FP32, [784])]
        assert config.HasField("dynamic_batching") and config.dynamic_batching.max_queue_delay_microseconds == 0


@pytest.mark.parametrize("fields, fragments", [({"name": "mnist"}, ["name: unknown model 'mnist'", "'capsnet'"]),
                                               ({"name": "capsnet", "version": "2"}, ["version:", "'2'", "'1'"])])
def test_our_stub_unknown_model_or_version_is_not_found(kserve_stub, fields, fragments):
    with pytest.raises(grpc.RpcError) as caught:
        kserve_stub.ModelConfig(pb.ModelConfigRequest(**fields), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    for fragment in fragments:
        assert fragment in caught.value.details()


@pytest.mark.parametrize("name, version, fragment", [("mnist", "", "unknown model 'mnist'"),
                                                     ("capsnet", "2", "has no version '2'")])
def test_tritonclient_unknown_model_or_version_is_not_found(triton, name, version, fragment):
    with pytest.raises(InferenceServerException) as error:
        triton.get_model_config(name, version)
    assert error.value.status() == "StatusCode.NOT_FOUND" and fragment in error.value.message()


# perf_analyzer: PERF_ANALYZER names the command, else `perf_analyzer` on PATH. Nothing is installed here.
PERF_ANALYZER = os.environ.get("PERF_ANALYZER") or shutil.which("perf_analyzer")


def _perf_analyzer_runs() -> str | None:
    """Why perf_analyzer cannot be used here, or None when it runs."""
    if not PERF_ANALYZER:
        return ("perf_analyzer not found: set PERF_ANALYZER to its path or put it on PATH (PyPI perf-analyzer, in a "
                "virtual environment of its own; docs/kserve.md says how it was run on Debian 12)")
    try:
        version = subprocess.run([PERF_ANALYZER, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as err:
        return f"perf_analyzer at {PERF_ANALYZER} does not start: {err}"
    if version.returncode != 0:
        return f"perf_analyzer at {PERF_ANALYZER} does not run: {(version.stderr or version.stdout).strip()[:300]}"
    return None


PERF_ANALYZER_MISSING = _perf_analyzer_runs()


@pytest.mark.skipif(PERF_ANALYZER_MISSING is not None, reason=PERF_ANALYZER_MISSING or "")
def test_perf_analyzer_measures_the_server(kserve_target, tmp_path):
    """perf_analyzer reads ModelMetadata and ModelConfig, then measures: a throughput, not one failed request, and the
    server's own split of a request's time from its statistics."""
    # perf_analyzer's default data is random bytes, which as FP32 include NaN and Inf, refused by the server (as it
    # should): send images in [0, 1] instead, from a data file.
    data = tmp_path / "images.json"
    data.write_text(json.dumps({"data": [{"images": {"content": image.ravel().tolist(), "shape": [1, 28, 28]}}
                                         for image in images(4, seed=5)]}))
    report = tmp_path / "perf.csv"
    completed = subprocess.run(
        [PERF_ANALYZER, "-m", "capsnet", "-i", "grpc", "-u", kserve_target, "--input-data", str(data), "-b", "1",
         "--concurrency-range", "1", "--measurement-mode", "count_windows", "--measurement-request-count", "50",
         # what is checked is a throughput, not its steadiness: any 3 windows in a row will do on a busy host
         "--stability-percentage", "100", "--max-trials", "10", "-f", str(report)],
        capture_output=True, text=True, timeout=120)
    output = completed.stdout + completed.stderr
    print(output)  # the figures, for pytest -s
    assert completed.returncode == 0, output
    assert not re.search(r"error|failed", output, re.IGNORECASE), output
    throughput = re.search(r"Concurrency: 1, throughput: ([\d.]+) infer/sec", output)
    assert throughput and float(throughput.group(1)) > 0, output
    # the server's side, from its statistics (ModelStatistics around each window): the requests the client counted,
    # each one image and one backend run at -b 1 and concurrency 1, and their time split
    client = re.search(r"Client:\s+Request count: (\d+)", output)
    server = re.search(r"Server:\s+Inference count: (\d+)\s+Execution count: (\d+)\s+Successful request count: "
                       r"(\d+)\s+Avg request latency: (\d+) usec \(overhead (\d+) usec \+ queue (\d+) usec \+ compute "
                       r"input (\d+) usec \+ compute infer (\d+) usec \+ compute output (\d+) usec\)", output)
    assert client and server, output
    inferences, executions, successes, latency, overhead, queue, *compute = map(int, server.groups())
    assert inferences == executions == successes, output
    assert abs(successes - int(client.group(1))) <= 1, output  # the one request in flight at a window's edge
    assert compute[1] > 0 and abs(overhead + queue + sum(compute) - latency) <= 5, output  # each part rounded to µs
    header, row = report.read_text().splitlines()[:2]
    assert float(dict(zip(header.split(","), row.split(",")))["Inferences/Second"]) > 0
