"""TLS + bearer-token auth (issue 27) on real processes: a bank and a scorer serving TLS with a
token (certificates made by `openssl` here), the scorer reaching the bank over TLS with the bank's
token. With credentials the stack answers; without the token (or with a wrong one) every kev call
and reflection is UNAUTHENTICATED; health stays open for probes; a plaintext client gets nothing."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest

from kev.serving.processes import RedisProc, bank_proc, free_port, scorer_proc
from kev.serving.security import client_channel
from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2 as pb, scorer_pb2_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def make_certs(d: Path) -> dict[str, Path]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kev-test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key", "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "2",
        "-extfile", "san.ext", "-out", "server.pem")
    (d / "scorer.token").write_text("scorer-secret\n")
    (d / "bank.token").write_text("bank-secret\n")
    return {n: d / f for n, f in (("ca", "ca.pem"), ("cert", "server.pem"), ("key", "server.key"),
                                  ("scorer_token", "scorer.token"), ("bank_token", "bank.token"))}


def test_tls_and_token_stack_answers_with_credentials_and_refuses_without(checkpoint):
    work = Path(tempfile.mkdtemp(prefix="kev-tls-"))
    redis = bank = scorer = None
    try:
        certs = make_certs(work)
        tls = {"KEV_TLS_CERT": str(certs["cert"]), "KEV_TLS_KEY": str(certs["key"])}
        redis = RedisProc(work)
        redis.start()
        bank_addr, scorer_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        bank = bank_proc(checkpoint, redis.url, bank_addr, work / "bank.log", memory_bytes=1 << 20,
                         flags=["--node", "tls", "--max-document-tokens", "512", "--avg-doc-tokens", "64"],
                         env={**tls, "KEV_AUTH_TOKEN_FILE": str(certs["bank_token"])})
        bank.tls_ca = str(certs["ca"])
        bank.start()
        bank.wait_serving(60)  # health over TLS, no token
        scorer = scorer_proc(checkpoint, redis.url, bank_addr, scorer_addr, work / "scorer.log",
                             flags=["--max-document-tokens", "512"],
                             env={**tls, "KEV_AUTH_TOKEN_FILE": str(certs["scorer_token"]),
                                  "KEV_BANK_TLS_CA": str(certs["ca"]), "KEV_BANK_TOKEN_FILE": str(certs["bank_token"])})
        scorer.tls_ca = str(certs["ca"])
        scorer.start()
        scorer.wait_serving(60)

        request = pb.ScoreQuestionsRequest(document_text="the customer is angry", questions={
            "q": pb.Question(type=pb.Question.NOUL, instructions="is it urgent")})
        ca = str(certs["ca"])
        with client_channel(scorer_addr, ca=ca, token="scorer-secret") as ch:
            reply = scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(request, timeout=60)
            assert 0 < reply.answers["q"].noul.p_yes < 1
        for token in (None, "wrong"):
            with client_channel(scorer_addr, ca=ca, token=token) as ch:
                with pytest.raises(grpc.RpcError) as err:
                    scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(request, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    scorer_pb2_grpc.ScorerStub(ch).ListModels(pb.ListModelsRequest(), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with client_channel(bank_addr, ca=ca, token="scorer-secret") as ch:  # the scorer's token is not the bank's
            with pytest.raises(grpc.RpcError) as err:
                bank_pb2_grpc.BankStub(ch).Stats(bank_pb2.StatsRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with client_channel(bank_addr, ca=ca, token="bank-secret") as ch:
            assert bank_pb2_grpc.BankStub(ch).Stats(bank_pb2.StatsRequest(), timeout=10).slots_used >= 1
        with grpc.insecure_channel(scorer_addr) as ch:  # plaintext: no TLS handshake, nothing served
            with pytest.raises(grpc.RpcError) as err:
                scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(request, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for proc in (scorer, bank, redis):
            if proc is not None:
                proc.stop(10)
        shutil.rmtree(work, ignore_errors=True)
