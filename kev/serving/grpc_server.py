"""One way to stand up a gRPC server: thread pool, message size limits, health, reflection, the port.

    server = GrpcServer(["kev.v1.Bank"], workers=64, thread_name_prefix="bank-rpc")
    bank_pb2_grpc.add_BankServicer_to_server(servicer, server.server)   # or server.add_handlers(...)
    server.start("0.0.0.0:50052")        # binds, or raises ListenError naming the address
    ...                                  # load, warm up
    server.set_serving(True)             # the named services SERVING in gRPC health
    ...
    server.set_serving(False); server.stop(grace_s)

Health (grpc.health.v1): the overall status "" is SERVING from construction (the process is up and
answers), each named service NOT_SERVING until `set_serving(True)`: Kubernetes' readiness probes and
the stack's start-up waits ask for the named service. Reflection lists the named services and
health. The port is bound without SO_REUSEPORT, so a second process on a taken port fails at start
instead of silently sharing it. Used by bank_service, scorer_service and bench/load_baseline.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # "grpc.health.v1.Health"
_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class ListenError(RuntimeError):
    """The server could not bind its address (taken, or not an address)."""


class GrpcServer:
    """A `grpc.Server` (`.server`) with its health servicer (`.health`) and reflection set up."""

    def __init__(self, services: Sequence[str], *, workers: int, thread_name_prefix: str,
                 max_message_bytes: int | None = None, reflect: bool = True,
                 credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.ServerInterceptor] = ()):
        self.services = tuple(services)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.health.set("", _SERVING)
        for name in self.services:
            self.health.set(name, _NOT_SERVING)
        options = [("grpc.so_reuseport", 0)]
        if max_message_bytes is not None:
            options += [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes)]
        self.credentials = credentials  # TLS (kev/serving/security.py); None: insecure
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name_prefix),
                                  options=options, interceptors=tuple(interceptors))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflect:
            reflection.enable_server_reflection((*self.services, HEALTH_SERVICE, reflection.SERVICE_NAME), self.server)
        self.port = 0

    def add_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(tuple(handlers))

    def start(self, listen: str) -> int:
        """Bind `listen` (host:port, port 0 for a free one, or unix:PATH) and start; returns the port."""
        try:
            port = self.server.add_insecure_port(listen) if self.credentials is None \
                else self.server.add_secure_port(listen, self.credentials)
        except RuntimeError as e:  # grpcio raises on a failed bind (older versions returned 0)
            raise ListenError(f"cannot listen on {listen}: {e} (is the port taken?)") from None
        if not port:
            raise ListenError(f"cannot listen on {listen} (is the port taken?)")
        self.server.start()
        self.port = port
        return port

    def set_serving(self, serving: bool) -> None:
        """The named services' health status."""
        for name in self.services:
            self.health.set(name, _SERVING if serving else _NOT_SERVING)

    def stop(self, grace_s: float | None) -> None:
        """Refuse new RPCs, let those in flight finish within `grace_s`, and wait until stopped."""
        self.server.stop(grace_s).wait()
