"""A small Python client of the CapsNet API (`capsnet predict` uses it), and the gRPC health check
(`capsnet health` and the container HEALTHCHECK use it).

    from capsnet.client.api import CapsNetClient
    with CapsNetClient("127.0.0.1:8001") as client:
        for p in client.classify(["digit.png"], top_k=3):
            print(p.class_name, p.probability, [name for _, name, _ in p.present_classes])
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # generous: the server derives its own from its model (~1.7 MB for digits)


@dataclass
class Prediction:
    class_index: int
    class_name: str
    probability: float
    probabilities: np.ndarray  # (J,)
    poses: np.ndarray | None  # (J, D); None when not asked, or for a model without poses (GetModelInfo's pose_dim 0)
    reconstruction: np.ndarray | None  # (C, H, W); None when not asked
    top_classes: list[tuple[int, str, float]]  # (index, name, probability), most probable first
    # every class over the request's present threshold (capsule length > 0.5 by default), most probable first:
    # several at once for an image of several objects
    present_classes: list[tuple[int, str, float]]
    resized_from: tuple[int, int] | None  # (H, W) of an encoded image resized to a fixed-size model's; None: not


def image_message(image: bytes | bytearray | memoryview | str | os.PathLike | np.ndarray) -> pb.Image:
    """PNG/JPEG bytes or a path to such a file -> encoded; a uint8 (0-255) or float (0-1) (C, H, W) array -> tensor.
    TypeError for arrays of other types, whose scale cannot be guessed (uint16 pixels? int64 labels?)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return pb.Image(encoded=bytes(image))
    if isinstance(image, (str, os.PathLike)):
        return pb.Image(encoded=Path(image).read_bytes())
    array = np.asarray(image)
    if array.dtype == np.uint8:
        return pb.Image(tensor=pb.Tensor(dtype=pb.DATA_TYPE_UINT8, shape=array.shape, data=array.tobytes()))
    if array.dtype.kind != "f":
        raise TypeError(f"an image array must be uint8 (0-255) or floating point (0-1), got {array.dtype}")
    data = np.ascontiguousarray(array, dtype="<f4").tobytes()
    return pb.Image(tensor=pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=array.shape, data=data))


def channel(target: str, *, tls_ca: str | os.PathLike | None = None, tls_cert: str | os.PathLike | None = None,
            tls_key: str | os.PathLike | None = None, options: list[tuple[str, int]] | None = None) -> grpc.Channel:
    """A channel to "host:port": TLS with tls_ca (the server's CA; None: system roots when tls_cert is given),
    mutual TLS adding tls_cert + tls_key; plaintext without either."""
    if bool(tls_cert) != bool(tls_key):  # grpc core aborts the process on a certificate without its key
        raise ValueError("tls_cert and tls_key go together")
    if tls_ca or tls_cert:
        credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca), private_key=_read(tls_key),
                                                   certificate_chain=_read(tls_cert))
        return grpc.secure_channel(target, credentials, options)
    return grpc.insecure_channel(target, options)


def check_health(target: str, service: str = "", *, timeout: float = 3.0, **tls) -> str:
    """grpc.health.v1 Check of `service` ("": the whole server) -> its status name, e.g. "SERVING" or "NOT_SERVING".

    `tls` takes channel()'s tls_ca, tls_cert, tls_key. Raises grpc.RpcError when the server cannot answer
    (UNAVAILABLE when nothing listens, NOT_FOUND for a service it does not know).
    """
    with channel(target, **tls) as health_channel:
        # types-grpcio-health-checking declares HealthStub without its methods
        reply = health_pb2_grpc.HealthStub(health_channel).Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class CapsNetClient:
    def __init__(self, target: str, *, tls_ca: str | os.PathLike | None = None,
                 tls_cert: str | os.PathLike | None = None, tls_key: str | os.PathLike | None = None,
                 timeout: float | None = 30.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        """target "host:port"; TLS with tls_ca (the server's CA; None: system roots when tls_cert is given),
        mutual TLS adding tls_cert + tls_key; timeout in seconds per call."""
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        self.channel = channel(target, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, options=options)
        self.stub = pb_grpc.CapsNetServiceStub(self.channel)
        self.timeout = timeout

    def classify(self, images, *, poses: bool = True, reconstruction: bool = False, top_k: int = 0,
                 present_threshold: float | None = None) -> list[Prediction]:
        """`present_threshold`: the length over which a class is present (None: the server's default, 0.5)."""
        request = pb.ClassifyRequest(images=[image_message(image) for image in images], exclude_poses=not poses,
                                     include_reconstruction=reconstruction, top_k=top_k,
                                     present_threshold=present_threshold)
        response = self.stub.Classify(request, timeout=self.timeout)
        return [_prediction(result) for result in response.results]

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self.timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "CapsNetClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read(path: str | os.PathLike | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _array(values: pb.FloatArray) -> np.ndarray | None:
    if not values.shape:
        return None
    return np.array(values.values, dtype=np.float32).reshape(tuple(values.shape))


def _prediction(result: pb.Classification) -> Prediction:
    return Prediction(
        class_index=result.predicted_class,
        class_name=result.predicted_name,
        probability=result.probabilities[result.predicted_class],
        probabilities=np.array(result.probabilities, dtype=np.float32),
        poses=_array(result.poses),
        reconstruction=_array(result.reconstruction),
        top_classes=[(score.index, score.name, score.probability) for score in result.top_classes],
        present_classes=[(score.index, score.name, score.probability) for score in result.present_classes],
        resized_from=(result.resized_from[0], result.resized_from[1]) if result.resized_from else None,
    )
