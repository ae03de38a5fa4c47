"""Request failures the router reports to clients as a gRPC status with a human message."""

from __future__ import annotations

import grpc


class RequestError(Exception):
    """An error to return to the client: a status code, a message, optional trailing metadata.

    `too_large` marks an INVALID_ARGUMENT about size in bytes (an item or the request over its byte
    limit): gRPC reports it like any bad input, the HTTP API answers 413 instead of 400.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        metadata: tuple[tuple[str, str], ...] = (),
        too_large: bool = False,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata
        self.too_large = too_large


def invalid(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def too_large(message: str) -> RequestError:
    """INVALID_ARGUMENT for a byte limit exceeded (HTTP 413)."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, too_large=True)


def unavailable(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)
