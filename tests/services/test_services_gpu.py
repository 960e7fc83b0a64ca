"""The whole stack on CUDA: bank_service and scorer_service with KEV_DEVICE=cuda (class-tuned,
warmed, graphed passes: kev/exec/passes.py) on the tiny checkpoint, against the in-process engine on
CUDA with the same kernels.

Each request is sent alone, so the scorer's row pass and the engine's fall in the same bucket.
Two processes autotune independently (and the GPU path promises no batch invariance), so answers
are compared within a tolerance, not bit for bit. Needs `redis-server` and the redis client:
the GPU device has neither, so there this test skips and says why.
"""

import shutil

import grpc
import pytest
import torch

from kev.request import api
from kev.bank.bank import Bank
from kev.engine import Engine
from kev.loading import LoadedModel
from kev.ops import get_ops
from kev.exec.plan import GraphPlan, parse_doc_buckets, parse_row_buckets
from kev.request.prompts import Limits

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2  # on probabilities; bf16 weights, configs tuned in three processes
SMALL_ROWS, SMALL_DOCS = "1x32,2x32,4x32,8x32,1x64,4x64", "1x64,1x256"


def test_cuda_stack_answers_like_the_cuda_engine(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH to run the stack (the GPU device has none)")
    pytest.importorskip("redis", reason="needs the redis client to run the stack")
    from kev.v1 import scorer_pb2_grpc
    from service_support import MAX_DOC_TOKENS, make_documents, make_requests, score, stack_for
    from tiny_stack import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "kev-tiny")
    requests = make_requests(24, make_documents(8), max_questions=4)
    loaded = LoadedModel.load(checkpoint, device="cuda", limits=Limits(max_document_tokens=MAX_DOC_TOKENS))
    bank = Bank.from_budget(loaded.model.cfg, 64 << 20, dtype=torch.bfloat16, device="cuda",
                            max_doc_tokens=MAX_DOC_TOKENS)
    plan = GraphPlan(rows=parse_row_buckets(SMALL_ROWS), docs=parse_doc_buckets(SMALL_DOCS), max_graphs=16)
    engine = Engine(loaded, bank, get_ops("triton"), plan)
    assert engine.passes.graphs is not None and len(engine.passes.graphs.graphs()) == 8
    want = [engine.score(r) for r in requests]

    cuda = {"KEV_DEVICE": "cuda", "KEV_MAX_GRAPHS": "16"}
    stack = stack_for(checkpoint, bank_env={**cuda, "KEV_GRAPH_DOCS": SMALL_DOCS},
                      scorer_env={**cuda, "KEV_GRAPH_ROWS": SMALL_ROWS})
    stack.start()
    try:
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            got = [score(stub, r) for r in requests]  # one at a time: the engine's buckets
            again = [score(stub, r) for r in requests]  # cached documents, graphs captured when idle
    finally:
        stack.stop()
    for g, a, w in zip(got, again, want):
        assert list(g.answers) == list(w.answers)
        for name in w.answers:
            for x, y, z in zip(api.option_probabilities(g.answers[name]), api.option_probabilities(a.answers[name]),
                               api.option_probabilities(w.answers[name])):
                assert abs(x - z) <= TOLERANCE and abs(y - z) <= TOLERANCE, (name, x, y, z)
