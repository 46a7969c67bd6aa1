"""Our `inference` protos are wire-compatible with tritonclient's: same messages, fields, numbers, types and RPCs.

Both are loaded here, in one process: ours live in capsnet.kserve.POOL, tritonclient's in protobuf's default pool.
grpc_service.proto declares whole messages of the protocol; model_config.proto only the fields of Triton's
ModelConfig this server fills, each the same as Triton's (a field left out is one the reader takes as default).
"""

from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2

from capsnet.kserve import grpc_service_pb2
from capsnet.kserve import model_config_pb2 as our_model_config_pb2

SERVED_RPCS = [
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer", "ModelConfig",
    "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister"]


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
    assert [method.name for method in our_service.method] == SERVED_RPCS
    for method in our_service.method:
        assert method == triton_methods[method.name], method.name


def assert_subset(ours: descriptor_pb2.DescriptorProto, triton: descriptor_pb2.DescriptorProto, path: str) -> None:
    """Every field of ours is Triton's field of that name, identical (number, type, label, type name, oneof)."""
    triton_fields = {field.name: field for field in triton.field}
    assert ours.field, f"{path}: no fields"
    for field in ours.field:
        assert field == triton_fields[field.name], f"{path}.{field.name}"
    triton_oneofs = [oneof.name for oneof in triton.oneof_decl]
    assert [oneof.name for oneof in ours.oneof_decl] == triton_oneofs[:len(ours.oneof_decl)], path
    triton_nested = {nested.name: nested for nested in triton.nested_type}
    for nested in ours.nested_type:
        assert_subset(nested, triton_nested[nested.name], f"{path}.{nested.name}")


def test_model_config_is_a_field_for_field_subset_of_tritons():
    triton = file_proto(model_config_pb2.DESCRIPTOR.serialized_pb)
    ours = file_proto(our_model_config_pb2.DESCRIPTOR.serialized_pb)

    assert ours.package == triton.package == "inference"
    triton_enums = {enum.name: enum for enum in triton.enum_type}
    assert [enum.name for enum in ours.enum_type] == ["DataType"]
    assert ours.enum_type[0] == triton_enums["DataType"]  # all values: an enum value is its wire meaning
    triton_messages = {message.name: message for message in triton.message_type}
    assert [message.name for message in ours.message_type] == [
        "ModelTensorReshape", "ModelInput", "ModelOutput", "ModelDynamicBatching", "ModelParameter", "ModelConfig"]
    for message in ours.message_type:
        assert_subset(message, triton_messages[message.name], message.name)


def test_a_model_config_of_ours_reads_the_same_with_tritons_schema():
    config = our_model_config_pb2
    ours = config.ModelConfig(
        name="capsnet", platform="onnxruntime_onnx", max_batch_size=8,
        input=[config.ModelInput(name="images", data_type=config.TYPE_FP32, dims=[1, 28, 28])],
        output=[config.ModelOutput(name="poses", data_type=config.TYPE_FP32, dims=[10, 16])],
        dynamic_batching=config.ModelDynamicBatching(max_queue_delay_microseconds=250))
    theirs = model_config_pb2.ModelConfig.FromString(ours.SerializeToString())
    assert (theirs.name, theirs.platform, theirs.max_batch_size) == ("capsnet", "onnxruntime_onnx", 8)
    assert (theirs.input[0].name, theirs.input[0].data_type, list(theirs.input[0].dims)) == (
        "images", model_config_pb2.TYPE_FP32, [1, 28, 28])
    assert (theirs.output[0].name, list(theirs.output[0].dims)) == ("poses", [10, 16])
    assert theirs.WhichOneof("scheduling_choice") == "dynamic_batching"
    assert theirs.dynamic_batching.max_queue_delay_microseconds == 250
