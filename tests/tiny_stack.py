"""A tiny but complete Kev stack for service tests (test support, not tests).

    from tiny_stack import make_tiny_checkpoint, start_bank, pack_tokens

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")            # random backbone + head + tokenizer
    bank = start_bank(ckpt, redis_server.url, tmp_path)        # `python -m bank_service`, SERVING
    resp = bank.stub().Acquire(pb.AcquireRequest(model=TINY_MODEL_ID, token_ids_le_i32=pack_tokens(ids)))
    bank.stop()                                                # SIGTERM; returns the exit code

The checkpoint directory is what KEV_CHECKPOINT points at: flat `config.json` + `model.safetensors`
(kev.random_models weights, norms and dt_bias randomised), `head.safetensors` (kev.request.head.save_head),
`tokenizer.json` (tests/tiny_tokenizer: word level over WORDS, Kev delimiters as special tokens)
and `kev.json` naming the model TINY_MODEL_ID. The processes are kev/serving/processes.py's (what
the embedded stack runs): `start_bank` only picks free ports and test-sized flags, `BankProcess`
adds a stub, the metrics scrape and the shared-memory files.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.load import scrape
from kev.request.head import DecisionHead, save_head
from kev.serving.processes import ServiceProc, bank_proc, free_port
from kev.v1 import bank_pb2_grpc
from random_models import random_model, tiny_config
from tiny_tokenizer import make_test_tokenizer

TINY_MODEL_ID = "kev-tiny"
WORDS = tuple(
    "the a an of to in on for with and or not is was be this that it as at by from customer ticket order "
    "invoice refund payment late delivery broken damaged screen phone laptop account password login error "
    "billing team support sales legal contract termination early notice days month year clause party "
    "agreement allow allowed may must shall terminate cancel fee penalty frustrated angry happy calm "
    "very slightly please help urgent still again since waiting reply email call chat which should handle "
    "does how what who when why level low medium high score yes no maybe product shipping address changed "
    "wrong item missing package received never arrived ago week weeks two three one hello thanks regards "
    "name ann bob carol dave team_a team_b question answer document text . , ! ? ; ' \" ( ) -".split()
)


def make_tiny_checkpoint(directory: str | Path, *, seed: int = 0, hv_per_h: int = 2,
                         model_id: str = TINY_MODEL_ID, head_dim: int = 16) -> Path:
    """Write a loadable Kev checkpoint directory (see the module docstring); returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(hv_per_h=hv_per_h)
    model = random_model(cfg, seed=seed)
    tokenizer = make_test_tokenizer(WORDS)
    if tokenizer.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, the model {cfg.vocab_size}")
    tensors = {"model." + k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(cfg.to_text_dict(), indent=2))
    g = torch.Generator().manual_seed(seed + 100)
    d = cfg.hidden_size
    head = DecisionHead(w_q=torch.randn(head_dim, d, generator=g) * 0.3, w_k=torch.randn(head_dim, d, generator=g) * 0.3,
                        b_q=None, b_k=None, temperature=1.0)
    save_head(directory / "head.safetensors", head)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "kev.json").write_text(json.dumps({"model_id": model_id}))
    return directory


def pack_tokens(ids) -> bytes:
    """Token ids as AcquireRequest.token_ids_le_i32 (little-endian int32)."""
    return torch.tensor(list(ids), dtype=torch.int32).numpy().astype("<i4").tobytes()


class BankProcess(ServiceProc):
    """A bank service process (kev/serving/processes.py) with the tests' helpers."""

    def stub(self) -> bank_pb2_grpc.BankStub:
        return bank_pb2_grpc.BankStub(self.channel)

    def metrics(self) -> dict[str, float]:
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def shm_files(self) -> list[Path]:
        """The /dev/shm files this bank process created (named after its instance, which has its pid)."""
        pattern = re.compile(rf"kev-bank-[0-9a-f]+-{self.pid}-[0-9a-f]+")
        return [p for p in Path("/dev/shm").iterdir() if pattern.fullmatch(p.name)]


def start_bank(checkpoint: str | Path, redis_url: str, log_dir: str | Path, *, memory_bytes: int = 4 << 20,
               lease_seconds: float = 30, metrics: bool = True, max_document_tokens: int = 512,
               avg_doc_tokens: int = 64, block_size: int = 64, max_wait_ms: float = 2,
               epoch_check_s: float = 0.2, node: str = "test-node", extra_args: tuple[str, ...] = (),
               env: dict[str, str] | None = None, wait: bool = True, timeout: float = 60) -> BankProcess:
    """A bank service process (kev.serving.processes.bank_proc) on free ports, on CPU, one torch
    thread; returns once SERVING.

    Defaults suit tests: a 4 MiB bank of ~120 one-page slots (64-token pages, 64-token average
    documents), documents up to 512 tokens, a 0.2 s epoch check so a Redis restart is noticed fast.
    """
    flags = ("--node", node, "--max-document-tokens", str(max_document_tokens), "--avg-doc-tokens",
             str(avg_doc_tokens), "--block-size", str(block_size), "--max-wait-ms", str(max_wait_ms),
             "--epoch-check-s", str(epoch_check_s), "--grpc-workers", "32", *extra_args)
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port, metrics_port = free_port(), free_port() if metrics else 0
    bank = bank_proc(checkpoint, redis_url, f"127.0.0.1:{port}", log_dir / f"bank-{time.time_ns()}.log",
                     memory_bytes=memory_bytes, lease_seconds=lease_seconds, metrics_port=metrics_port,
                     flags=flags, env=env, cls=BankProcess)
    bank.port, bank.metrics_port = port, metrics_port
    bank.start()
    if wait:
        try:
            bank.wait_serving(timeout)
        except BaseException:
            bank.kill()
            raise
    return bank
