"""The whole stack on CUDA: bank_service and scorer_service with KEV_DEVICE=cuda (class-tuned,
warmed, graphed passes: kev/exec/passes.py) on the tiny checkpoint, against the in-process engine on
CUDA with the same kernels.

Each request is sent alone, so the scorer's row pass and the engine's fall in the same key: both
have the same small pass caps (few keys to capture at start-up), the bank's state passes too.
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
from kev.exec.plan import GraphPlan
from kev.request.prompts import Limits

pytestmark = pytest.mark.gpu

TOLERANCE = 2e-2  # on probabilities; bf16 weights, configs tuned in three processes
# Pass caps: a scorer's rows (KEV_MAX_TOKENS_PER_PASS, KEV_MAX_ROWS_PER_PASS) and the bank's
# documents (--max-pass-tokens, --max-pass-documents; documents are at most MAX_DOC_TOKENS = 512).
ROW_TOKENS, ROW_SEQS, STATE_TOKENS, STATE_SEQS = 512, 8, 512, 4


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
    plan = GraphPlan(row_tokens=ROW_TOKENS, row_seqs=ROW_SEQS, state_tokens=STATE_TOKENS, state_seqs=STATE_SEQS)
    engine = Engine(loaded, bank, get_ops("triton"), plan)
    graphs = engine.passes.graphs
    assert graphs is not None and set(graphs.graphs()) == set(graphs.all_keys())  # every key, at start-up
    want = [engine.score(r) for r in requests]

    stack = stack_for(checkpoint, bank_env={"KEV_DEVICE": "cuda"},
                      bank_flags=["--avg-doc-tokens", "64", "--epoch-check-s", "0.2",  # stack_for's own
                                  "--max-pass-tokens", str(STATE_TOKENS), "--max-pass-documents", str(STATE_SEQS)],
                      scorer_env={"KEV_DEVICE": "cuda", "KEV_MAX_TOKENS_PER_PASS": str(ROW_TOKENS),
                                  "KEV_MAX_ROWS_PER_PASS": str(ROW_SEQS)})
    stack.start()
    try:
        with grpc.insecure_channel(stack.scorer_addr) as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            got = [score(stub, r) for r in requests]  # one at a time: the engine's keys
            again = [score(stub, r) for r in requests]  # cached documents: row passes alone
    finally:
        stack.stop()
    for g, a, w in zip(got, again, want):
        assert list(g.answers) == list(w.answers)
        for name in w.answers:
            for x, y, z in zip(api.option_probabilities(g.answers[name]), api.option_probabilities(a.answers[name]),
                               api.option_probabilities(w.answers[name])):
                assert abs(x - z) <= TOLERANCE and abs(y - z) <= TOLERANCE, (name, x, y, z)
