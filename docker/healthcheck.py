#!/usr/bin/env python3
"""Health probe for containers: exit 0 when the server's gRPC health service says SERVING, 1 otherwise.

Docker's HEALTHCHECK runs a command inside the container, and the image has Python and grpcio already,
so this replaces a separate grpc_health_probe binary. Kubernetes uses its native `grpc:` probe instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?",
                        default=f"127.0.0.1:{os.environ.get('CAPSNET_GRPC_PORT', '8001')}",
                        help="host:port of the gRPC server (default 127.0.0.1:$CAPSNET_GRPC_PORT, else 8001)")
    parser.add_argument("--service", default="", help="service name to check (default '': the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up (default 3)")
    args = parser.parse_args(argv)

    with grpc.insecure_channel(args.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"{args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
