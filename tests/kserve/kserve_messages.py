"""Building KServe v2 requests and reading responses with our generated stubs, shared by the kserve tests."""

import numpy as np

from capsnet.kserve import grpc_service_pb2 as pb

MAX_BATCH_SIZE = 8  # of the kserve test servers; test_kserve_errors sends 9 images to cross it
# What ServerMetadata lists on a server of the CPU: every extension it serves, and no CUDA shared memory.
CPU_EXTENSIONS = ["model_configuration", "statistics", "model_repository", "model_repository(unload_dependents)",
                  "binary_tensor_data", "classification", "system_shared_memory"]


def images(count: int, seed: int) -> np.ndarray:
    """`count` random 1x28x28 float32 images in [0, 1) (the tiny preset's input)."""
    return np.random.default_rng(seed).random((count, 1, 28, 28), dtype=np.float32)


def infer_request(batch: np.ndarray, *, raw: bool, outputs=(), **fields) -> pb.ModelInferRequest:
    """A ModelInfer request for model `capsnet` with `batch` as FP32 input `images`, raw or typed."""
    request = pb.ModelInferRequest(model_name="capsnet", **fields)
    tensor = request.inputs.add(name="images", datatype="FP32", shape=batch.shape)
    if raw:
        request.raw_input_contents.append(batch.astype("<f4").tobytes())
    else:
        tensor.contents.fp32_contents.extend(batch.ravel().tolist())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def response_arrays(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """Output name -> float32 array of its shape, from raw or typed contents, whichever the response used."""
    arrays = {}
    for index, output in enumerate(response.outputs):
        assert output.datatype == "FP32"
        if response.raw_output_contents:
            values = np.frombuffer(response.raw_output_contents[index], dtype="<f4")
        else:
            values = np.array(output.contents.fp32_contents, dtype=np.float32)
        arrays[output.name] = values.reshape(list(output.shape))
    return arrays
