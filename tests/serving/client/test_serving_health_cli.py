"""`capsnet health`: grpc.health.v1 Check against a real server; SERVING exits 0, anything else is one error line."""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from capsnet.cli import build_parser, main
from capsnet.client.api import check_health
from capsnet.client.cli import DEFAULT_SERVER, server_address


def one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == "", captured
    assert lines[0].startswith("capsnet health: error: ")
    return lines[0]


@pytest.mark.parametrize("service", ["", "capsnet.v1.CapsNetService", "inference.GRPCInferenceService"])
def test_health_of_a_serving_server(server, capsys, service):
    assert main(["health", "--server", server.target, "--service", service]) == 0
    assert capsys.readouterr().out == f"{server.target}{f' {service}' if service else ''}: SERVING\n"


def test_health_with_the_longest_timeout(server, capsys):
    # 1e10 overflowed gRPC's deadline into DEADLINE_EXCEEDED at once; the largest accepted value must not
    assert main(["health", "--server", server.target, "--timeout", "3600"]) == 0
    assert capsys.readouterr().out.endswith(": SERVING\n")


def test_health_of_an_unknown_service_is_not_found(server, capsys):
    assert main(["health", "--server", server.target, "--service", "no.such.Service"]) == 2
    assert one_error_line(capsys).endswith(
        f"{server.target}: NOT_FOUND: the server reports no health for service 'no.such.Service'")


def test_a_server_without_a_port_is_dialled_on_8001(capsys):
    # nothing listens on 127.0.0.1:8001 in the tests: the refusal names the port dialled (gRPC's own default is 443)
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", 8001)) == 0:
            pytest.skip("something listens on 127.0.0.1:8001 here")
    assert main(["health", "--server", "127.0.0.1", "--timeout", "5"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("capsnet health: error: 127.0.0.1:8001: UNAVAILABLE"), line


@pytest.mark.parametrize("given, dialled", [
    ("localhost", "localhost:8001"), ("localhost:", "localhost:8001"), ("localhost:9000", "localhost:9000"),
    ("::1", "[::1]:8001"), ("fe80::", "[fe80::]:8001"), ("[::1]", "[::1]:8001"), ("[::1]:", "[::1]:8001"),
    ("[::1]:9000", "[::1]:9000"), ("unix:/run/capsnet.sock", "unix:/run/capsnet.sock"),
    ("unix:capsnet.sock", "unix:capsnet.sock"),
    ("dns:///capsnet.example:9000", "dns:///capsnet.example:9000"), ("ipv6:[::1]:9000", "ipv6:[::1]:9000"),
])
def test_server_address_without_a_port_gets_8001(given, dialled):
    assert server_address(given) == dialled


def test_health_of_a_not_serving_server(capsys):
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # what a draining capsnet server answers
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        assert main(["health", "--server", f"127.0.0.1:{port}"]) == 2
    finally:
        grpc_server.stop(None)
    assert one_error_line(capsys).endswith(f"127.0.0.1:{port}: NOT_SERVING")


def test_health_with_nothing_listening(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connections are refused
        assert main(["health", "--server", f"127.0.0.1:{port}", "--timeout", "5"]) == 2
    assert f"127.0.0.1:{port}: UNAVAILABLE" in one_error_line(capsys)


def test_health_bad_timeout_is_refused(capsys):
    assert main(["health", "--timeout", "0"]) == 2
    assert "--timeout must be > 0" in one_error_line(capsys)


# predict and health share these checks; each runs before any channel opens, so no server is needed.
@pytest.mark.parametrize("command", ["health", "predict"])
@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "client.pem"], "--tls-cert and --tls-key go together"),  # grpc core aborted the process
    (["--tls-key", "client.key"], "--tls-cert and --tls-key go together"),  # was silently ignored
    (["--timeout", "inf"], "--timeout must be > 0"),
    (["--timeout", "nan"], "--timeout must be > 0"),
    (["--timeout", "1e10"], "--timeout must be > 0 and at most 3600"),  # gRPC overflowed to DEADLINE_EXCEEDED
    (["--timeout", "0"], "--timeout must be > 0"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--server", "127.0.0.1:99999"], "port must be 1-65535, got 99999"),  # gRPC dialled 99999 % 65536
])
def test_client_flags_are_checked(capsys, command, flags, message):
    argv = [command, "--server", "127.0.0.1:1", *flags] + (["image.png"] if command == "predict" else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == "", captured
    assert lines[0].startswith(f"capsnet {command}: error: ") and message in lines[0]


def test_client_with_cert_without_key_raises_instead_of_aborting():
    with pytest.raises(ValueError, match="go together"):
        check_health("127.0.0.1:1", tls_cert="client.pem")


@pytest.mark.parametrize("value, expected", [("", DEFAULT_SERVER), ("10.0.0.1:9000", "10.0.0.1:9000")])
def test_empty_capsnet_server_counts_as_unset(monkeypatch, value, expected):
    monkeypatch.setenv("CAPSNET_SERVER", value)
    assert build_parser().parse_args(["health"]).server == expected
