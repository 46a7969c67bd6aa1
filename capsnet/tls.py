"""TLS files, checked and read once, with one set of error messages: the server's (gRPC and REST serve the same
certificate) and the client commands'.

Python's OpenSSL parses them first: for a file with no certificate in it, or a key that does not match, gRPC says
only "Failed to create security handshaker" (after lines of its own core log), and an encrypted key would make
OpenSSL ask for its password on the terminal. Errors are one CapsNetError line naming the flags.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capsnet.errors import CapsNetError


@dataclass(frozen=True)
class ServerTLS:
    """The server's certificate and key, and with client_ca mutual TLS: clients must present a certificate it signed."""

    cert: bytes
    key: bytes
    client_ca: bytes | None
    context: ssl.SSLContext  # for HTTPS

    @classmethod
    def load(cls, cert: Path, key: Path, client_ca: Path | None) -> "ServerTLS":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        _load_pair(context, cert, key, "--tls-cert", "--tls-key")
        if client_ca is not None:
            _load_ca(context, client_ca, "--tls-client-ca")
            context.verify_mode = ssl.CERT_REQUIRED
        return cls(_read(cert), _read(key), None if client_ca is None else _read(client_ca), context)

    def grpc_credentials(self):
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


def check_client_files(ca: str | None, cert: str | None, key: str | None) -> None:
    """The client commands' --tls-ca, --tls-cert and --tls-key, before any channel opens."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca:
        _load_ca(context, ca, "--tls-ca")
    if cert:
        _load_pair(context, cert, key, "--tls-cert", "--tls-key")


def _load_pair(context: ssl.SSLContext, cert, key, cert_flag: str, key_flag: str) -> None:
    # password b"": an encrypted key fails here instead of OpenSSL asking for its password on the terminal
    _load(f"{cert_flag} {cert}, {key_flag} {key}: not a PEM certificate and its unencrypted private key", (cert, key),
          lambda: context.load_cert_chain(cert, key, password=b""))


def _load_ca(context: ssl.SSLContext, ca, flag: str) -> None:
    _load(f"{flag} {ca}: no PEM certificate in it", (ca,), lambda: context.load_verify_locations(cafile=ca))


def _load(what: str, paths: tuple, load: Callable[[], None]) -> None:
    try:
        load()
    except ssl.SSLError as err:  # its reason names a mismatch; otherwise it is only "PEM lib"
        raise CapsNetError(what + (f" ({err.reason})" if err.reason else "")) from None
    except OSError as err:  # OpenSSL does not say which file
        unreadable = next((path for path in paths if not os.access(path, os.R_OK) or os.path.isdir(path)), paths[0])
        raise CapsNetError(f"cannot read {unreadable}: {err.strerror}") from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:  # removed or made unreadable since it was loaded
        raise CapsNetError(f"cannot read {path}: {err.strerror or err}") from None
