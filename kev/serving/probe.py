"""`python -m kev.serving.probe ADDR [--service NAME] [--tls-ca PEM] [--server-name NAME]`: one gRPC
health check, for Kubernetes exec probes where the kubelet's own gRPC probe cannot go.

The kubelet's `grpc:` probe dials the pod IP in plaintext: it cannot reach the bank on its pod-local
unix socket (`KEV_BANK_LISTEN=unix:/run/kev-bank/bank.sock`), nor a scorer that serves TLS only.
This asks `grpc.health.v1.Health/Check` for `--service` (default `""`: the process answers at all)
over `ADDR` (`unix:/path` or `host:port`), with TLS when `--tls-ca` is given (`--server-name`: the
name the certificate was issued for, when ADDR is 127.0.0.1). Health is open without a token
(kev/serving/security.py). Exit 0: SERVING; 1: anything else (the status, or the error, on stderr).
Imports only grpc (no torch): ~0.2 s of CPU per probe.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(addr: str, service: str = "", *, tls_ca: str | None = None, server_name: str | None = None,
          timeout: float = 3.0) -> int:
    """The health status (health_pb2.HealthCheckResponse.ServingStatus) of `service` at `addr`."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    if tls_ca:
        with open(tls_ca, "rb") as f:
            channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(f.read()), options=options)
    else:
        channel = grpc.insecure_channel(addr, options=options)
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout).status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kev.serving.probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("addr", help="unix:/path or host:port")
    parser.add_argument("--service", default="", help='health service name (default "": liveness)')
    parser.add_argument("--tls-ca", help="PEM CA of the server's certificate: check over TLS")
    parser.add_argument("--server-name", help="the certificate's name, when it is not ADDR's host")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        status = check(args.addr, args.service, tls_ca=args.tls_ca, server_name=args.server_name,
                       timeout=args.timeout)
    except (grpc.RpcError, OSError) as e:
        detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
        print(f"{args.addr} {args.service or '(process)'}: {detail}", file=sys.stderr)
        return 1
    if status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.addr} {args.service or '(process)'}: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
