"""TLS and mutual TLS with a throwaway CA made by the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import numpy as np
import pytest
from PIL import Image

from capsnet.cli import main
from capsnet.serving.client import CapsNetClient
from serving_helpers import ServerThread, server_config

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
        "server": make_leaf(directory, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
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


def test_tls(model_dir, pki):
    key, cert = pki["server"]
    running = ServerThread(server_config(model_dir, tls_cert=cert, tls_key=key))
    try:
        assert 0 <= classify(running.target, tls_ca=pki["ca"][1]) < 10
        assert refused(running.target) == grpc.StatusCode.UNAVAILABLE  # plaintext client
        assert refused(running.target, tls_ca=pki["other_ca"][1]) == grpc.StatusCode.UNAVAILABLE  # untrusted server
    finally:
        running.stop()


def test_mutual_tls(model_dir, pki, capsys, tmp_path):
    key, cert = pki["server"]
    running = ServerThread(server_config(model_dir, tls_cert=cert, tls_key=key, tls_client_ca=pki["ca"][1]))
    client_key, client_cert = pki["client"]
    try:
        assert 0 <= classify(running.target, tls_ca=pki["ca"][1], tls_cert=client_cert, tls_key=client_key) < 10
        assert refused(running.target, tls_ca=pki["ca"][1]) == grpc.StatusCode.UNAVAILABLE  # no client certificate
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
