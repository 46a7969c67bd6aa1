"""Our `inference` proto is wire-compatible with tritonclient's: same messages, fields, numbers, types and RPCs.

Both are loaded here, in one process: ours lives in capsnet.kserve.POOL, tritonclient's in protobuf's default pool.
"""

from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2

from capsnet.kserve import grpc_service_pb2


def file_proto(serialized: bytes) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(serialized)


def test_messages_and_rpcs_match_tritonclient():
    triton = file_proto(service_pb2.DESCRIPTOR.serialized_pb)
    ours = file_proto(grpc_service_pb2.DESCRIPTOR.serialized_pb)

    assert ours.package == triton.package == "inference"
    triton_messages = {message.name: message for message in triton.message_type}
    assert ours.message_type, "no messages generated"
    for message in ours.message_type:
        assert message == triton_messages[message.name], message.name

    [our_service] = ours.service
    triton_service = {service.name: service for service in triton.service}[our_service.name]
    triton_methods = {method.name: method for method in triton_service.method}
    assert [method.name for method in our_service.method] == [
        "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer"]
    for method in our_service.method:
        assert method == triton_methods[method.name], method.name
