"""Our `inference` proto is wire-compatible with tritonclient's: same messages, fields, numbers, types and RPCs.

tritonclient's file descriptor is read in a child interpreter and compared here as plain
FileDescriptorProto data, never registered: both files define package `inference`, and one
protobuf pool cannot hold both.
"""

import base64
import subprocess
import sys

from google.protobuf import descriptor_pb2

from capsnet.kserve import grpc_service_pb2

READ_TRITON_DESCRIPTOR = (
    "import base64\n"
    "from tritonclient.grpc import service_pb2\n"
    "print(base64.b64encode(service_pb2.DESCRIPTOR.serialized_pb).decode())\n"
)


def file_proto(serialized: bytes) -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(serialized)


def test_messages_and_rpcs_match_tritonclient():
    completed = subprocess.run([sys.executable, "-c", READ_TRITON_DESCRIPTOR],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    triton = file_proto(base64.b64decode(completed.stdout))
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
