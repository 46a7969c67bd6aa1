"""Child process: drive a KServe v2 server with an unchanged tritonclient.grpc and print the results as JSON.

Run by test_kserve_tritonclient.py in its own interpreter: tritonclient.grpc and our generated
capsnet.kserve code both define the protobuf package `inference`, and one process cannot load both.

usage: python tritonclient_calls.py HOST:PORT IMAGES.npy
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main(target: str, images_path: str) -> dict:
    images = np.load(images_path)
    client = grpcclient.InferenceServerClient(url=target)
    try:
        images_input = grpcclient.InferInput("images", list(images.shape), "FP32")
        images_input.set_data_from_numpy(images)
        requested = [grpcclient.InferRequestedOutput("poses"), grpcclient.InferRequestedOutput("probabilities")]
        result = client.infer("capsnet", [images_input], outputs=requested, request_id="triton-1",
                              client_timeout=30)
        response = result.get_response()
        try:
            client.is_model_ready("no-such-model")
            unknown_model_error = None
        except InferenceServerException as err:
            unknown_model_error = {"status": err.status(), "message": err.message()}
        return {
            "live": client.is_server_live(),
            "ready": client.is_server_ready(),
            "model_ready": client.is_model_ready("capsnet"),
            "server_metadata": client.get_server_metadata(as_json=True),
            "model_metadata": client.get_model_metadata("capsnet", as_json=True),
            "infer": {
                "id": response.id,
                "model_name": response.model_name,
                "model_version": response.model_version,
                "output_names": [output.name for output in response.outputs],
                "probabilities": result.as_numpy("probabilities").tolist(),
                "poses": result.as_numpy("poses").tolist(),
            },
            "unknown_model_error": unknown_model_error,
        }
    finally:
        client.close()


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:])))
