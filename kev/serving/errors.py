"""Service failures and their gRPC status codes: one exception per status, shared by both services.

A service raises one of these where the failure happens; its RPC handler answers with `abort(context, e)`
(the exception's `code` and message). Bad request content found by the request layer is
`kev.request.errors.InvalidRequest` (it names the field; the scorer answers it INVALID_ARGUMENT).

    Unavailable         the bank or Redis cannot be reached, or the service is starting or draining: safe to retry
    Exhausted           RESOURCE_EXHAUSTED: a queue is full, or the bank stayed full of pinned entries
    DeadlineExceeded    the caller's deadline passed (or every caller gave up waiting)
    Cancelled           the client went away
    InvalidArgument     a malformed request the service itself rejects (the message starts with the field)
    Internal            anything else; also the base class's code
"""

from __future__ import annotations

from typing import NoReturn

import grpc


class ServiceError(Exception):
    """A failure with a gRPC status: `code`, answered with the message."""

    code = grpc.StatusCode.INTERNAL

    @property
    def label(self) -> str:
        """The status as a metric label: "unavailable", "resource_exhausted", ..."""
        return self.code.name.lower()


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(ServiceError):
    """The bank or Redis cannot be reached, or the service is starting or draining: safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class Exhausted(ServiceError):
    """A queue is full, or the bank stayed full of pinned entries for its --full-wait-ms."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


def abort(context: grpc.ServicerContext, error: ServiceError) -> NoReturn:
    """End the RPC with the error's status and message."""
    context.abort(error.code, str(error))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
