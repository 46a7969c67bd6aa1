"""`capsnet predict` and `capsnet health`: the client commands, which import no server code. grpc is
imported inside the handlers."""

from __future__ import annotations

import argparse
import json
import math
import os
import re

from capsnet.errors import CapsNetError

DEFAULT_SERVER = "127.0.0.1:8001"
# Longer deadlines are a typo rather than a wish; gRPC also overflows on huge ones (1e10 s) and expires at once.
MAX_TIMEOUT_S = 3600.0


def default_server() -> str:
    """$CAPSNET_SERVER where set and not empty (`CAPSNET_SERVER=` unsets it, as for most variables), else the
    default."""
    return os.environ.get("CAPSNET_SERVER") or DEFAULT_SERVER


GRPC_TARGET_SCHEMES = ("unix:", "unix-abstract:", "vsock:", "ipv4:", "ipv6:", "dns:")


def server_address(value: str) -> str:
    """--server: HOST[:PORT]. gRPC dials port 443 for a name without one; a capsnet server listens on 8001.
    gRPC targets with a scheme (unix:/path, dns:///name, ipv4:..., ipv6:...) are passed on as they are."""
    if "/" in value or value.startswith(GRPC_TARGET_SCHEMES):
        return value
    port = DEFAULT_SERVER.rpartition(":")[2]
    if value.count(":") > 1 and not value.startswith("["):  # a bare IPv6 address: brackets before the port
        return f"[{value}]:{port}"
    value = value.removesuffix(":")  # "host:" gives no port either
    if ":" not in value or value.endswith("]"):
        return f"{value}:{port}"
    return value


def add_connection_args(parser: argparse.ArgumentParser, timeout_s: float) -> None:
    """TLS and the deadline, the same for every client command."""
    parser.add_argument("--tls-ca", metavar="PEM", help="CA certificate of the server (enables TLS)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key", metavar="PEM", help="client private key, for mutual TLS")
    parser.add_argument("--timeout", type=float, default=timeout_s,
                        help=f"seconds to wait for the answer (default {timeout_s:g}, at most {MAX_TIMEOUT_S:g})")


def register(subparsers) -> None:
    predict = subparsers.add_parser("predict", help="classify image files with a running server",
                                    description="Send PNG/JPEG files to a capsnet server and print each one's class.")
    predict.add_argument("images", nargs="+", metavar="IMG", help="PNG or JPEG files")
    predict.add_argument("--server", default=default_server(), type=server_address, metavar="HOST:PORT",
                         help=f"server address, HOST[:PORT] (port 8001 if none; default $CAPSNET_SERVER or "
                              f"{DEFAULT_SERVER})")
    predict.add_argument("--top-k", type=int, default=1, metavar="K",
                         help="print the K most probable classes (default 1)")
    predict.add_argument("--present-threshold", type=float, metavar="P",
                         help="a class is present when its probability (capsule length) is above P, 0 to 1 "
                              "(default: the server's, 0.5); every present class is printed")
    predict.add_argument("--poses", action="store_true", help="also print every class capsule's pose vector")
    predict.add_argument("--json", action="store_true", help="print JSON (one object per image, in a list)")
    predict.add_argument("--reconstruction", metavar="PNG",
                         help="write the reconstruction from each image's predicted capsule as PNG: to PNG for one "
                              "image, to <stem>-0.png, <stem>-1.png, ... (in argument order) for several; "
                              "the model must be exported with --reconstruction")
    add_connection_args(predict, timeout_s=30.0)
    predict.set_defaults(handler=run_predict)

    health = subparsers.add_parser("health", help="ask a running server whether it is serving (gRPC health check)",
                                   description="grpc.health.v1 Check against a server, as grpcurl or grpc_health_probe "
                                               "would: prints SERVING and exits 0, else one error line and exits 2.")
    health.add_argument("--server", default=default_server(), type=server_address, metavar="HOST:PORT",
                        help=f"server address, HOST[:PORT] (port 8001 if none; default $CAPSNET_SERVER or "
                             f"{DEFAULT_SERVER})")
    health.add_argument("--service", default="", metavar="NAME",
                        help="one API, e.g. inference.GRPCInferenceService (default '': the whole server)")
    add_connection_args(health, timeout_s=3.0)
    health.set_defaults(handler=run_health)


def quiet_grpc_log() -> None:
    """Client commands answer in one line: gRPC's C core would log its own lines around it (a failed TLS handshake, a
    refused certificate). Before grpc is imported; GRPC_VERBOSITY set by the user wins."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")


def run_predict(args: argparse.Namespace) -> int:
    quiet_grpc_log()
    import grpc

    from capsnet.client.api import CapsNetClient

    if args.top_k < 1:
        raise CapsNetError(f"--top-k must be >= 1, got {args.top_k}")
    if args.present_threshold is not None and not 0 <= args.present_threshold <= 1:
        raise CapsNetError(f"--present-threshold must be 0 to 1, got {args.present_threshold:g}")
    check_client_args(args)
    for path in args.images:
        if not os.path.isfile(path):
            raise CapsNetError(f"{path} is not a file")
    try:
        with CapsNetClient(args.server, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key,
                           timeout=args.timeout) as client:
            if args.poses:
                check_poses(client, args.server)
            predictions = classify_files(client, args.images, args.server, poses=args.poses, top_k=args.top_k,
                                         reconstruction=args.reconstruction is not None,
                                         present_threshold=args.present_threshold)
    except grpc.RpcError as err:
        raise CapsNetError(f"{args.server}: {err.code().name}: {err.details()}") from None
    except OSError as err:
        raise CapsNetError(f"cannot read {err.filename}: {err.strerror}") from None
    written: list[str | None] = [None] * len(predictions)
    if args.reconstruction is not None:
        targets = reconstruction_paths(args.reconstruction, len(predictions))
        for target, prediction in zip(targets, predictions):
            write_png(prediction.reconstruction, target)
        written = list(targets)
    if args.json:
        print(json.dumps([_as_json(path, p, args.poses, png)
                          for path, p, png in zip(args.images, predictions, written)], indent=2))
        return 0
    for path, prediction, png in zip(args.images, predictions, written):
        # one line per image: the top class, then every class present (several for an image of several objects)
        present = ", ".join(f"{index} {name!r}" for index, name, _ in prediction.present_classes) or "none"
        resized = (f"; resized from {'x'.join(map(str, prediction.resized_from))}, aspect ratio kept"
                   if prediction.resized_from else "")
        print(f"{path}: {prediction.class_index} {prediction.class_name!r} p={prediction.probability:.4f}; "
              f"present: {present}{resized}")
        if png:
            print(f"  reconstruction: {png}")
        for rank, (index, name, probability) in enumerate(prediction.top_classes[1:], start=2):
            print(f"  #{rank}: {index} {name!r} p={probability:.4f}")
        if args.poses:
            for index, pose in enumerate(prediction.poses):
                print(f"  pose {index}: " + " ".join(f"{v:+.4f}" for v in pose))
    return 0


def check_poses(client, server: str) -> None:
    """--poses for a model without poses (a CNN baseline) is one line naming what it serves, not empty poses."""
    info = client.model_info()
    if not info.pose_dim:
        raise CapsNetError(f"{server}: --poses: model {info.name!r} has no poses (its outputs: "
                           f"{', '.join(info.output_names)}); leave --poses out")


def classify_files(client, paths: list[str], server: str, **options) -> list:
    """Every file, in requests of at most the server's max_batch_size (a glob may match more); an image the server
    refuses is named by its file instead of its index in the request."""
    import grpc

    per_request = client.model_info().max_batch_size if len(paths) > 1 else 1
    predictions = []
    for start in range(0, len(paths), per_request):
        chunk = paths[start:start + per_request]
        try:
            predictions += client.classify(chunk, **options)
        except grpc.RpcError as err:
            details = err.details() or ""
            field = re.match(r"images\[(\d+)\][.\w]*: ", details)
            if err.code() != grpc.StatusCode.INVALID_ARGUMENT or field is None:
                raise
            raise CapsNetError(f"{server}: INVALID_ARGUMENT: {chunk[int(field[1])]}: {details[field.end():]}") from None
    return predictions


def run_health(args: argparse.Namespace) -> int:
    quiet_grpc_log()
    import grpc

    from capsnet.client.api import check_health

    check_client_args(args)
    try:
        status = check_health(args.server, args.service, timeout=args.timeout, tls_ca=args.tls_ca,
                              tls_cert=args.tls_cert, tls_key=args.tls_key)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:  # the health service says no more than the code
            raise CapsNetError(f"{args.server}: NOT_FOUND: the server reports no health for service "
                               f"{args.service!r}") from None
        raise CapsNetError(f"{args.server}: {err.code().name}: {err.details()}") from None
    except OSError as err:
        raise CapsNetError(f"cannot read {err.filename}: {err.strerror}") from None
    if status != "SERVING":
        raise CapsNetError(f"{args.server}{f' {args.service}' if args.service else ''}: {status}")
    print(f"{args.server}{f' {args.service}' if args.service else ''}: {status}")
    return 0


def check_client_args(args: argparse.Namespace) -> None:
    """What `predict` and `health` share: --server, --timeout and the TLS files, checked before any channel opens."""
    _, colon, port = args.server.rpartition(":")
    # Only a numeric port is checked: targets such as unix:/path or dns:///name are gRPC's to parse. Out of range,
    # gRPC would quietly connect to the port modulo 65536 and report that one.
    if colon and port.isdigit() and not 1 <= int(port) <= 65535:
        raise CapsNetError(f"--server {args.server}: port must be 1-65535, got {port}")
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise CapsNetError(f"--timeout must be > 0 and at most {MAX_TIMEOUT_S:g} seconds, got {args.timeout:g}")
    # grpc core aborts the whole process on a certificate without its key; a key alone would be silently ignored.
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CapsNetError("--tls-cert and --tls-key go together")
    from capsnet.tls import check_client_files

    check_client_files(args.tls_ca, args.tls_cert, args.tls_key)


def reconstruction_paths(target: str, count: int) -> list[str]:
    """out.png for one image; out-0.png, out-1.png, ... for several."""
    if count == 1:
        return [target]
    stem, suffix = os.path.splitext(target)
    return [f"{stem}-{index}{suffix}" for index in range(count)]


def write_png(reconstruction, path: str) -> None:
    """A (C, H, W) [0, 1] reconstruction -> an 8-bit grey (C = 1) or RGB (C = 3) PNG."""
    import numpy as np
    from PIL import Image

    pixels = np.rint(np.clip(reconstruction, 0, 1) * 255).astype(np.uint8)  # (C, H, W)
    if pixels.shape[0] not in (1, 3):
        raise CapsNetError(f"cannot write a {pixels.shape[0]}-channel reconstruction as PNG")
    image = (Image.fromarray(pixels[0]) if pixels.shape[0] == 1
             else Image.fromarray(pixels.transpose(1, 2, 0)))  # (H, W[, 3])
    try:
        image.save(path, format="PNG")
    except OSError as err:
        raise CapsNetError(f"cannot write {path}: {err.strerror or err}") from None


def _as_json(path: str, prediction, poses: bool, reconstruction: str | None) -> dict:
    item = {
        "image": path,
        "class": prediction.class_index,
        "name": prediction.class_name,
        "probability": prediction.probability,
        "probabilities": prediction.probabilities.tolist(),
        "top_classes": [{"class": i, "name": n, "probability": p} for i, n, p in prediction.top_classes],
        "present_classes": [{"class": i, "name": n, "probability": p} for i, n, p in prediction.present_classes],
        "resized_from": list(prediction.resized_from) if prediction.resized_from else None,
    }
    if poses:
        item["poses"] = prediction.poses.tolist()
    if reconstruction:
        item["reconstruction"] = reconstruction
    return item
