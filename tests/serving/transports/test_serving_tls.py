"""TLS and mutual TLS with a throwaway CA made by the openssl CLI."""

from __future__ import annotations

import http.client
import logging
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from PIL import Image
from serving_helpers import ServerThread, server_config

from capsnet.cli import main
from capsnet.client.api import CapsNetClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl CLI is not installed")
IMAGE = np.random.default_rng(4).random((1, 28, 28), dtype=np.float32)  # (1, 28, 28)


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(directory, name: str):
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
            "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return key, cert


def make_leaf(directory, name: str, ca, extensions: str):
    key, csr, cert, ext = (directory / f"{name}.{suffix}" for suffix in ("key", "csr", "pem", "ext"))
    ext.write_text(extensions + "\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]), "-CAcreateserial",
            "-days", "1", "-out", str(cert), "-extfile", str(ext))
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory, "test-ca")
    return {
        "ca": ca,
        "server": make_leaf(directory, "server", ca,
                            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        "client": make_leaf(directory, "client", ca, "extendedKeyUsage=clientAuth"),
        "other_ca": make_ca(directory, "other-ca"),
    }


def classify(target: str, **tls) -> int:
    with CapsNetClient(target, timeout=10, **tls) as client:
        return client.classify([IMAGE])[0].class_index


def refused(target: str, **tls) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        classify(target, **tls)
    return caught.value.code()


def rest_ready(running: ServerThread, ca=None, client=None, scheme: str = "https") -> int:
    """The REST port's readiness status over HTTPS trusting `ca` (with `client`'s certificate, for mutual TLS)."""
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client[1], client[0])
    url = f"{scheme}://127.0.0.1:{running.server.http_port}/v2/health/ready"
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        return response.status


def test_tls(model_dir, pki):
    key, cert = pki["server"]
    running = ServerThread(server_config(model_dir, tls_cert=cert, tls_key=key))
    try:
        assert 0 <= classify(running.target, tls_ca=pki["ca"][1]) < 10
        assert refused(running.target) == grpc.StatusCode.UNAVAILABLE  # plaintext client
        assert refused(running.target, tls_ca=pki["other_ca"][1]) == grpc.StatusCode.UNAVAILABLE  # untrusted server
        # REST: HTTPS with the same certificate, and nothing in plain HTTP
        assert rest_ready(running, ca=pki["ca"][1]) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            rest_ready(running, ca=pki["other_ca"][1])
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            rest_ready(running, scheme="http")
    finally:
        running.stop()


def test_mutual_tls(model_dir, pki, capsys, tmp_path):
    key, cert = pki["server"]
    running = ServerThread(server_config(model_dir, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"][1]))
    client_key, client_cert = pki["client"]
    try:
        assert 0 <= classify(running.target, tls_ca=pki["ca"][1], tls_cert=client_cert, tls_key=client_key) < 10
        assert refused(running.target, tls_ca=pki["ca"][1]) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert rest_ready(running, ca=pki["ca"][1], client=pki["client"]) == 200
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            rest_ready(running, ca=pki["ca"][1])  # no client certificate
        png = tmp_path / "digit.png"
        Image.fromarray((IMAGE[0] * 255).astype(np.uint8)).save(png)
        code = main(["predict", str(png), "--server", running.target, "--tls-ca", str(pki["ca"][1]),
                     "--tls-cert", str(client_cert), "--tls-key", str(client_key)])
        assert code == 0 and capsys.readouterr().out.startswith(f"{png}: ")
        tls = ["--tls-ca", str(pki["ca"][1]), "--tls-cert", str(client_cert), "--tls-key", str(client_key)]
        assert main(["health", "--server", running.target, *tls]) == 0
        assert capsys.readouterr().out == f"{running.target}: SERVING\n"
        assert main(["health", "--server", running.target, *tls[:2]]) == 2  # no client certificate
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        running.stop()


def unusable_files(directory, key):
    """A file with a certificate's markers and no certificate in them, and `key` encrypted with a password."""
    not_pem = directory / "not.pem"
    not_pem.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    encrypted = directory / "encrypted.key"
    openssl("pkey", "-in", str(key), "-aes256", "-passout", "pass:secret", "-out", str(encrypted))
    return not_pem, encrypted


def test_unusable_tls_files_are_one_line_errors_before_any_connection(pki, tmp_path):
    """gRPC would say only "Failed to create security handshaker", after lines of its own core log."""
    client_key, client_cert = pki["client"]
    not_pem, encrypted = unusable_files(tmp_path, client_key)
    cases = {
        ("--tls-ca", str(not_pem)): f"--tls-ca {not_pem}: no PEM certificate in it",
        ("--tls-ca", str(tmp_path)): f"cannot read {tmp_path}: Is a directory",
        ("--tls-cert", str(client_cert), "--tls-key", str(pki["server"][0])):
            f"--tls-cert {client_cert}, --tls-key {pki['server'][0]}: not a PEM certificate and its unencrypted "
            "private key (KEY_VALUES_MISMATCH)",
        ("--tls-cert", str(client_cert), "--tls-key", str(encrypted)):
            f"--tls-cert {client_cert}, --tls-key {encrypted}: not a PEM certificate and its unencrypted private key",
    }
    for flags, message in cases.items():
        # a subprocess: gRPC reads GRPC_VERBOSITY once, when it is first imported; stdin closed, as OpenSSL would
        # prompt on it for the password of an encrypted key
        run = subprocess.run([sys.executable, "-m", "capsnet", "health", "--server", "127.0.0.1:9", *flags],
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert (run.returncode, run.stderr) == (2, f"capsnet health: error: {message}\n")


def test_client_commands_print_one_line_for_a_failed_handshake(server, pki):
    # a TLS client against the plaintext test server: gRPC's core would log the failed handshake on a line of its own
    run = subprocess.run([sys.executable, "-m", "capsnet", "health", "--server", server.target, "--tls-ca",
                          str(pki["ca"][1])], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    [line] = run.stderr.splitlines()
    assert line.startswith(f"capsnet health: error: {server.target}: UNAVAILABLE: "), line
    assert "handshake" in line.lower(), line


def test_unusable_server_tls_files_are_one_line_errors_before_the_model_loads(model_dir, pki, tmp_path, capsys,
                                                                              caplog):
    """gRPC and HTTPS serve the same files, checked once with the client commands' messages."""
    key, cert = pki["server"]
    not_pem, encrypted = unusable_files(tmp_path, key)
    cases = {
        ("--tls-cert", str(not_pem), "--tls-key", str(key)):
            f"--tls-cert {not_pem}, --tls-key {key}: not a PEM certificate and its unencrypted private key",
        ("--tls-cert", str(cert), "--tls-key", str(pki["client"][0])):
            f"--tls-cert {cert}, --tls-key {pki['client'][0]}: not a PEM certificate and its unencrypted private key "
            "(KEY_VALUES_MISMATCH)",
        ("--tls-cert", str(cert), "--tls-key", str(encrypted)):
            f"--tls-cert {cert}, --tls-key {encrypted}: not a PEM certificate and its unencrypted private key",
        ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(not_pem)):
            f"--tls-client-ca {not_pem}: no PEM certificate in it",
        ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(tmp_path)):
            f"cannot read {tmp_path}: Is a directory",
    }
    for flags, message in cases.items():
        with caplog.at_level(logging.INFO, logger="capsnet.serving"):
            code = main(["serve", "--model", str(model_dir), "--grpc-port", "0", "--http-port", "0", "--metrics-port",
                         "0", *flags])
        err = capsys.readouterr().err
        assert (code, err.splitlines()[-1:]) == (2, [f"capsnet serve: error: {message}"]), err
        assert not [record for record in caplog.records if "loaded" in record.getMessage()], "the model was loaded"
