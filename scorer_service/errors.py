"""Failures of the scorer that are not the client's fault, each with its gRPC status code.

(Bad input is `kev.request.errors.InvalidRequest`, answered INVALID_ARGUMENT; see server.py.)
"""

from __future__ import annotations

import grpc


class ServiceError(Exception):
    """A failure with a gRPC status; server.py answers `code` with the message."""

    code = grpc.StatusCode.INTERNAL


class Unavailable(ServiceError):
    """The bank or Redis cannot be reached, or the scorer is draining: safe to retry."""

    code = grpc.StatusCode.UNAVAILABLE


class StaleAttachment(Unavailable):
    """The handle belongs to another bank instance or is no longer live: the request retries once."""


class Exhausted(ServiceError):
    """The row queue is full, or the bank stayed full of pinned entries for its --full-wait-ms."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED
