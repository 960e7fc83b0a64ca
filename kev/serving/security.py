"""TLS and bearer-token authentication of the services' gRPC APIs (issue 27), gRPC's own credentials
and a server interceptor.

Settings (both services, their own listener): KEV_TLS_CERT + KEV_TLS_KEY (PEM files: the server
serves TLS only), KEV_TLS_CLIENT_CA (PEM: clients must present a certificate it signed, mTLS),
KEV_AUTH_TOKEN_FILE (a file holding the bearer token every call must carry as
`authorization: Bearer <token>`; otherwise UNAUTHENTICATED). gRPC health stays open to probes;
reflection and every kev method are behind the token. Unset: insecure and open, as before.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # probes carry no token


def read_token(path: str | None) -> str | None:
    if not path:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"{path}: empty token file")
    return token


@dataclass(frozen=True)
class ServerSecurity:
    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None
    token_file: str | None = None

    def credentials(self) -> grpc.ServerCredentials | None:
        if not self.cert:
            return None
        pair = (Path(self.key).read_bytes(), Path(self.cert).read_bytes())
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def interceptors(self) -> tuple[grpc.ServerInterceptor, ...]:
        token = read_token(self.token_file)
        return (TokenInterceptor(token),) if token else ()


class TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries `authorization: Bearer <token>` (health exempt)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")

    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[kind](abort, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)


def client_channel(addr: str, *, ca: str | None = None, token: str | None = None, cert: str | None = None,
                   key: str | None = None, options: list | None = None) -> grpc.Channel:
    """A channel to `addr`: TLS when `ca` (PEM path) is given (with a client certificate for mTLS),
    the bearer token on every call when `token` is."""
    if ca is None:
        if token is not None:
            raise ValueError("a bearer token needs TLS (give the server's CA)")
        return grpc.insecure_channel(addr, options=options)
    creds = grpc.ssl_channel_credentials(Path(ca).read_bytes(), Path(key).read_bytes() if key else None,
                                         Path(cert).read_bytes() if cert else None)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc.secure_channel(addr, creds, options=options)
