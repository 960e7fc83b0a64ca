"""A long document's state pass stays within `Passes.state_pass_peak_bytes` (H200; `gpu` marker).

A small model (width 512, 4 layers) with Kev-4B's heads (H 16, HV 32, K = V = 128; Hq 16, Hkv 4,
head_dim 256), random bf16 weights, fused projections, `TritonOps`. A document of three chunks
(4,096 tokens per pass, the last one partial) is read after a warm-up pass of the same shapes
(compiles and autotunes: the autotuner's benchmark buffers are not the pass's), and the peak
allocation above what was allocated before the pass must stay within the bound, and within a few
MB of one single chunk's peak: nothing grows with the document, the state rides in its slot.
"""

import pytest
import torch

from kev.bank.bank import Bank
from kev.ops.triton_ops import TritonOps
from kev.exec.passes import Passes
from random_models import random_model
from kernel_support import kev4b_heads_config

pytestmark = pytest.mark.gpu

CHUNK = 4096


def peak_of(runner, doc, handle) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.state_pass([doc], [handle])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_long_document_peak_memory_within_bound():
    cfg = kev4b_heads_config()
    model = random_model(cfg, seed=1, dtype=torch.bfloat16).set_batch_invariant(0).cuda().fuse_projections()
    n_long = 3 * CHUNK - 100
    pages = -(-n_long // 64)
    bank = Bank.allocate(cfg, num_slots=4, num_blocks=4 * pages, block_size=64, dtype=torch.bfloat16,
                         device="cuda", max_doc_tokens=n_long)
    runner = Passes(model, bank, TritonOps(), state_chunk_tokens=CHUNK)
    g = torch.Generator().manual_seed(0)
    long_doc = torch.randint(0, cfg.vocab_size, (n_long,), generator=g).tolist()
    one_chunk = long_doc[:CHUNK]
    warm = bank.alloc(n_long)
    runner.state_pass([long_doc], [warm])  # compiles and autotunes every shape of the passes below
    runner.state_pass([one_chunk], [warm])
    peak_one = peak_of(runner, one_chunk, bank.alloc(CHUNK))
    h_long = bank.alloc(n_long)
    peak_long = peak_of(runner, long_doc, h_long)
    bound = runner.state_pass_peak_bytes([n_long])
    assert bound == runner.state_pass_peak_bytes([CHUNK])  # the bound is one chunk's
    print(f"\nstate pass of {n_long} tokens in chunks of {CHUNK}: peak {peak_long / 2**20:.1f} MiB, "
          f"one chunk {peak_one / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB ({peak_long / bound:.2f} of it)")
    assert peak_long <= bound
    assert peak_long <= peak_one + 8 * 2**20, "a chunked document's peak grew with its length"
    for p in bank.pools.recurrent:  # the pass wrote real states
        assert torch.isfinite(p[h_long.slot]).all() and p[h_long.slot].abs().sum() > 0
