"""Error kinds carry their own gRPC code and HTTP status (serving/errors.py): a kind defined here, by a subclass, is
answered and counted with the codes it states or inherits, on gRPC (KServe and our API) and REST alike, against a
real server."""

import http.client
import json
import re

import grpc
import numpy as np
import pytest
from kserve_messages import images, infer_request
from serving_helpers import metric, scrape

from capsnet.client.api import image_message
from capsnet.kserve import grpc_service_pb2_grpc as kserve_pb_grpc
from capsnet.serving.errors import QueueFull, ServingError
from capsnet.v1 import capsnet_pb2 as pb
from capsnet.v1 import capsnet_pb2_grpc


class Overloaded(QueueFull):
    """States no codes: QueueFull's."""


class ModelBusy(ServingError):
    grpc_code, http_status = "FAILED_PRECONDITION", 409


class Unexplained(ServingError):
    """The base kind's: a server fault."""


def rest_infer(port: int, batch: np.ndarray) -> tuple[int, dict]:
    body = json.dumps({"inputs": [{"name": "images", "datatype": "FP32", "shape": list(batch.shape),
                                   "data": batch.ravel().tolist()}]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v2/models/capsnet/infer", body=body)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.mark.parametrize("kind, grpc_code, http_status", [
    (Overloaded, grpc.StatusCode.UNAVAILABLE, 503),
    (ModelBusy, grpc.StatusCode.FAILED_PRECONDITION, 409),
    (Unexplained, grpc.StatusCode.INTERNAL, 500),
])
def test_a_new_error_kind_is_answered_and_counted_by_its_codes_on_every_transport(kserve_rest, monkeypatch, kind,
                                                                                  grpc_code, http_status):
    message = f"refused by {kind.__name__}"

    def refuse(arrival):
        raise kind(message)

    monkeypatch.setattr(kserve_rest.server.service, "check_arrival", refuse)
    before = scrape(kserve_rest.metrics_url)
    batch = images(1, seed=51)
    assert rest_infer(kserve_rest.server.http_port, batch) == (http_status, {"error": message})
    with grpc.insecure_channel(kserve_rest.target) as channel:
        calls = [lambda: kserve_pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                     infer_request(batch, raw=True), timeout=30),
                 lambda: capsnet_pb2_grpc.CapsNetServiceStub(channel).Classify(
                     pb.ClassifyRequest(images=[image_message(batch[0])]), timeout=30)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert (caught.value.code(), caught.value.details()) == (grpc_code, message)
    after = scrape(kserve_rest.metrics_url)
    for api, method in (("kserve_http", "ModelInfer"), ("kserve", "ModelInfer"), ("capsnet", "Classify")):
        labels = {"name": "capsnet_requests_total", "api": api, "method": method, "code": grpc_code.name}
        assert metric(after, **labels) - metric(before, **labels) == 1, labels


@pytest.mark.parametrize("codes, fault", [
    ({"grpc_code": "NO_SUCH_CODE"}, "grpc_code must name a gRPC error status, got 'NO_SUCH_CODE'"),
    ({"grpc_code": "OK"}, "grpc_code must name a gRPC error status, got 'OK'"),
    ({"http_status": 200}, "http_status must be an HTTP error status, got 200"),
])
def test_a_kind_with_codes_no_transport_can_answer_is_refused_where_it_is_defined(codes, fault):
    with pytest.raises(TypeError, match=re.escape(f"Bad.{fault}")):
        type("Bad", (ServingError,), codes)
