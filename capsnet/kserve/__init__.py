"""KServe v2 gRPC code generated from protos/capsnet/kserve/*.proto (grpc_service, and model_config for Triton's
ModelConfig extension), in a descriptor pool of its own.

Their package is `inference`, as in every KServe v2 / Triton client, tritonclient among them. In
protobuf's default pool both would collide ("duplicate symbol 'inference.ServerLiveRequest'") in any
process that imports tritonclient.grpc beside the server, so scripts/gen_protos.sh registers ours in POOL.
The wire names (`inference.GRPCInferenceService/ModelInfer`, message layouts) stay those of KServe v2.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool

POOL = descriptor_pool.DescriptorPool()


class _PoolsDatabase:
    """A descriptor database over POOL, then the default pool: what gRPC reflection reads."""

    def FindFileByName(self, name: str) -> descriptor_pb2.FileDescriptorProto:  # protobuf's names
        return self._find("FindFileByName", name)

    def FindFileContainingSymbol(self, symbol: str) -> descriptor_pb2.FileDescriptorProto:
        return self._find("FindFileContainingSymbol", symbol)

    @staticmethod
    def _find(method: str, key: str) -> descriptor_pb2.FileDescriptorProto:
        for pool in (POOL, descriptor_pool.Default()):
            try:
                found = getattr(pool, method)(key)
            except KeyError:
                continue
            return descriptor_pb2.FileDescriptorProto.FromString(found.serialized_pb)
        raise KeyError(key)


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """A pool that finds our `inference` files (POOL first) and every other service's (the default pool),
    for grpc_reflection's `enable_server_reflection(..., pool=reflection_pool())`."""
    return descriptor_pool.DescriptorPool(descriptor_db=_PoolsDatabase())
