"""The scorer's client certificate to a bank that requires mTLS (KEV_BANK_TLS_CERT / KEV_BANK_TLS_KEY)
and the metrics bind address (KEV_METRICS_ADDR), on real processes with openssl certificates
(test_tls_auth.make_certs), plus their configuration checks."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from bank_service.config import BankConfig
from bench.load import scrape
from kev.serving.processes import RedisProc, bank_proc, free_port, scorer_proc
from kev.serving.security import client_channel
from kev.v1 import bank_pb2, bank_pb2_grpc, scorer_pb2 as pb, scorer_pb2_grpc
from scorer_service.config import ConfigError, ScorerConfig
from test_tls_auth import make_certs

SCORER_ENV = {"KEV_CHECKPOINT": "/ckpt", "KEV_REDIS_URL": "redis://localhost:6379/0", "KEV_DEVICE": "cpu"}
BANK_ENV = {**SCORER_ENV, "KEV_BANK_MEMORY_BYTES": "1000000"}


def test_config_checks():
    ok = ScorerConfig.from_env({**SCORER_ENV, "KEV_BANK_TLS_CA": "ca", "KEV_BANK_TLS_CERT": "c",
                                "KEV_BANK_TLS_KEY": "k", "KEV_METRICS_ADDR": "127.0.0.1"}, [])
    assert (ok.bank_tls_cert, ok.bank_tls_key, ok.metrics_addr) == ("c", "k", "127.0.0.1")
    assert ScorerConfig.from_env(SCORER_ENV, ["--metrics-addr", "::1"]).metrics_addr == "::1"  # the flag
    assert ScorerConfig.from_env(SCORER_ENV, []).metrics_addr == "0.0.0.0"
    with pytest.raises(ConfigError, match="KEV_BANK_TLS_CERT and KEV_BANK_TLS_KEY go together"):
        ScorerConfig.from_env({**SCORER_ENV, "KEV_BANK_TLS_CA": "ca", "KEV_BANK_TLS_CERT": "c"}, [])
    with pytest.raises(ConfigError, match="KEV_BANK_TLS_CERT needs KEV_BANK_TLS_CA"):
        ScorerConfig.from_env({**SCORER_ENV, "KEV_BANK_TLS_CERT": "c", "KEV_BANK_TLS_KEY": "k"}, [])
    assert BankConfig.from_env({**BANK_ENV, "KEV_METRICS_ADDR": "127.0.0.1"}, []).metrics_addr == "127.0.0.1"
    assert BankConfig.from_env(BANK_ENV, []).metrics_addr == "0.0.0.0"
    assert BankConfig.from_env({**BANK_ENV, "KEV_METRICS_ADDR": ""}, []).metrics_addr == "0.0.0.0"  # empty: unset


def _listening_ipv4(port: int) -> set[str]:
    """Local IPv4 addresses with a TCP socket listening on `port` (/proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        host, p = local.split(":")
        if state == "0A" and int(p, 16) == port:
            found.add(".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


@pytest.mark.slow  # a whole TLS stack (~45 s on CI's 2 cores); test_tls_auth.py's stack covers TLS in CI
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_scorer_presents_its_certificate_to_a_bank_requiring_mtls_metrics_on_loopback(checkpoint):
    work = Path(tempfile.mkdtemp(prefix="kev-mtls-"))
    redis = bank = scorer = None
    try:
        certs = make_certs(work)  # server.pem has no extended key usage: it serves as the client's too
        ca = str(certs["ca"])
        redis = RedisProc(work)
        redis.start()
        bank_addr, scorer_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        bank_metrics, scorer_metrics = free_port(), free_port()
        bank = bank_proc(checkpoint, redis.url, bank_addr, work / "bank.log", memory_bytes=1 << 20,
                         metrics_port=bank_metrics,
                         flags=["--node", "mtls", "--max-document-tokens", "512", "--avg-doc-tokens", "64"],
                         env={"KEV_TLS_CERT": str(certs["cert"]), "KEV_TLS_KEY": str(certs["key"]),
                              "KEV_TLS_CLIENT_CA": ca, "KEV_METRICS_ADDR": "127.0.0.1"})
        bank.start()
        scorer = scorer_proc(checkpoint, redis.url, bank_addr, scorer_addr, work / "scorer.log",
                             metrics_port=scorer_metrics, flags=["--max-document-tokens", "512"],
                             env={"KEV_BANK_TLS_CA": ca, "KEV_BANK_TLS_CERT": str(certs["cert"]),
                                  "KEV_BANK_TLS_KEY": str(certs["key"]), "KEV_METRICS_ADDR": "127.0.0.1"})
        scorer.start()
        scorer.wait_serving(90)  # SERVING only once attached to the bank, through mTLS

        request = pb.ScoreQuestionsRequest(document_text="the customer is angry", questions={
            "q": pb.Question(type=pb.Question.NOUL, instructions="is it urgent")})
        with grpc.insecure_channel(scorer_addr) as ch:
            reply = scorer_pb2_grpc.ScorerStub(ch).ScoreQuestions(request, timeout=60)
            assert 0 < reply.answers["q"].noul.p_yes < 1 and reply.usage.cached_state_tokens == 0
        with client_channel(bank_addr, ca=ca) as ch:  # TLS without a client certificate: refused
            with pytest.raises(grpc.RpcError) as err:
                bank_pb2_grpc.BankStub(ch).Stats(bank_pb2.StatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with client_channel(bank_addr, ca=ca, cert=str(certs["cert"]), key=str(certs["key"])) as ch:
            assert bank_pb2_grpc.BankStub(ch).Stats(bank_pb2.StatsRequest(), timeout=10).slots_used >= 1

        for port, metric in ((bank_metrics, "kev_bank_queue_depth"), (scorer_metrics, "kev_scorer_queue_depth")):
            assert _listening_ipv4(port) == {"127.0.0.1"}, port  # loopback only, not 0.0.0.0
            assert metric in scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        for proc in (scorer, bank, redis):
            if proc is not None:
                proc.stop(10)
        shutil.rmtree(work, ignore_errors=True)
