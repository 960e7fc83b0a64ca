"""kev.serving.probe, the exec probe of the deployment (deploy/base/serving-deployment.yaml): the bank on
its pod-local unix socket, the scorer over TLS (which the kubelet's own gRPC probe cannot do)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from kev.serving.grpc_server import GrpcServer
from kev.serving.probe import main


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kev.serving.probe", *args], capture_output=True, text=True,
                          timeout=30)


def test_probe_over_a_unix_socket_readiness_and_liveness():
    work = Path(tempfile.mkdtemp(prefix="kev-probe-"))
    server = GrpcServer(["kev.v1.Bank"], workers=2, thread_name_prefix="probe-test")
    try:
        addr = f"unix:{work}/bank.sock"
        import socket

        stale = socket.socket(socket.AF_UNIX)  # a dead bank's socket file: a restarted bank binds over it
        stale.bind(f"{work}/bank.sock")
        stale.close()
        server.start(addr)
        assert _run(addr).returncode == 0  # liveness: the process answers
        not_ready = _run(addr, "--service", "kev.v1.Bank")
        assert not_ready.returncode == 1 and "NOT_SERVING" in not_ready.stderr
        server.set_serving(True)
        assert main([addr, "--service", "kev.v1.Bank"]) == 0
        assert main([addr, "--service", "kev.v1.Nope"]) == 1  # NOT_FOUND
    finally:
        server.stop(0)
    gone = _run(addr, "--timeout", "0.5")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr
    shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_probe_over_tls_with_the_certificates_name():
    work = Path(tempfile.mkdtemp(prefix="kev-probe-"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=kev-scorer.kev.svc.cluster.local", "-addext",
                    "subjectAltName=DNS:kev-scorer.kev.svc.cluster.local", "-keyout", "tls.key", "-out", "tls.crt"],
                   check=True, capture_output=True, cwd=work)
    pair = ((work / "tls.key").read_bytes(), (work / "tls.crt").read_bytes())
    server = GrpcServer(["kev.v1.Scorer"], workers=2, thread_name_prefix="probe-test",
                        credentials=grpc.ssl_server_credentials([pair]))
    try:
        port = server.start("127.0.0.1:0")
        server.set_serving(True)
        addr, ca = f"127.0.0.1:{port}", str(work / "tls.crt")
        assert main([addr, "--service", "kev.v1.Scorer", "--tls-ca", ca,
                     "--server-name", "kev-scorer.kev.svc.cluster.local"]) == 0
        assert main([addr, "--tls-ca", ca, "--timeout", "1"]) == 1  # 127.0.0.1 is not the certificate's name
        assert main([addr, "--timeout", "1"]) == 1  # plaintext to a TLS-only server
    finally:
        server.stop(0)
        shutil.rmtree(work, ignore_errors=True)
