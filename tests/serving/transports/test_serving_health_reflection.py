"""Standard gRPC health checking and server reflection, as grpc_health_probe and grpcurl use them."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

EXPECTED_SERVICES = {
    "capsnet.v1.CapsNetService",
    "inference.GRPCInferenceService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
}


def test_health_is_serving_for_the_server_and_each_api(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "capsnet.v1.CapsNetService", "inference.GRPCInferenceService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service
    try:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        raise AssertionError("an unknown service must be NOT_FOUND")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_services_and_describes_our_api(channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    assert set(database.get_services()) == EXPECTED_SERVICES
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName("capsnet.v1.CapsNetService")
    assert [m.name for m in service.methods] == ["Classify", "ClassifyStream", "GetModelInfo"]
    stream = service.methods_by_name["ClassifyStream"]
    assert stream.client_streaming and stream.server_streaming
    image = pool.FindMessageTypeByName("capsnet.v1.Image")
    assert [f.name for f in image.oneofs_by_name["data"].fields] == ["encoded", "tensor"]
    kserve = pool.FindServiceByName("inference.GRPCInferenceService")
    assert "ModelInfer" in kserve.methods_by_name
