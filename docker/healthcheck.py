#!/usr/bin/env python3
"""Health probe for containers: exit 0 when the server's gRPC health service says SERVING, 1 otherwise.

Docker's HEALTHCHECK runs a command inside the container, and the image has capsnet-serve already, so this
replaces a separate grpc_health_probe binary. It is `capsnet health` with Docker's exit codes (1, not 2, for
unhealthy) and the container's $CAPSNET_GRPC_PORT. Kubernetes uses its native `grpc:` probe instead.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from capsnet.client.api import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address", nargs="?",
                        default=f"127.0.0.1:{os.environ.get('CAPSNET_GRPC_PORT', '8001')}",
                        help="host:port of the gRPC server (default 127.0.0.1:$CAPSNET_GRPC_PORT, else 8001)")
    parser.add_argument("--service", default="", help="service name to check (default '': the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up (default 3)")
    args = parser.parse_args(argv)

    try:
        status = check_health(args.address, args.service, timeout=args.timeout)
    except grpc.RpcError as err:
        print(f"{args.address}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
