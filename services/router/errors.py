"""Request failures the router reports to clients as a gRPC status with a human message."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """An error to return to the client: a status code, a message, optional trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)
