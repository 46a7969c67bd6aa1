"""The error of one request: answered with its gRPC status and message, the server carries on."""

from __future__ import annotations

import grpc


class ServingError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
