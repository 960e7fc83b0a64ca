"""Whole-model state and row passes straight from `PassMeta`, for the kernel tests (CPU and GPU).

Builds its own pools and block tables (optionally as strided views of larger buffers) so the
kernel tests do not depend on the bank allocator's API.
"""

import contextlib

import torch

from kev.bank.layout import StatePools
from kev.ops.meta import PassMeta


def packed(lens, device="cpu"):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64,
                        device=device)


def make_pools(cfg, num_slots, max_doc_tokens, block_size, dtype, device, strided=False):
    """(pools, block table [num_slots, MB] int32); slot s owns pages [s * MB, (s + 1) * MB)."""
    MB = -(-max_doc_tokens // block_size)
    shapes = StatePools.shapes(cfg, num_slots, num_slots * MB, block_size)

    def alloc(shape, dt):
        if not strided:
            return torch.zeros(shape, dtype=dt, device=device)
        base = torch.zeros((2 * shape[0] + 1, *[d + 1 for d in shape[1:]]), dtype=dt, device=device)
        return base[1::2][(slice(None), *[slice(1, 1 + d) for d in shape[1:]])]

    n_delta, n_attn = len(cfg.deltanet_layers), len(cfg.attention_layers)
    pools = StatePools(
        recurrent=tuple(alloc(shapes["recurrent"], torch.float32) for _ in range(n_delta)),
        conv=tuple(alloc(shapes["conv"], dtype) for _ in range(n_delta)),
        keys=tuple(alloc(shapes["kv"], dtype) for _ in range(n_attn)),
        values=tuple(alloc(shapes["kv"], dtype) for _ in range(n_attn)),
        block_size=block_size,
    )
    table = torch.arange(num_slots * MB, dtype=torch.int32, device=device).view(num_slots, MB)
    return pools, table


@torch.no_grad()
def state_pass(model, ops, pools, table, docs, slots, chunk=None):
    """Write each document's states into its slot; long documents in chunks carried in the slot."""
    device = table.device
    done, chunk = 0, chunk or max(len(d) for d in docs)
    while done < max(len(d) for d in docs):
        live = [i for i, d in enumerate(docs) if len(d) > done]
        parts = [docs[i][done:done + chunk] for i in live]
        s = torch.tensor([slots[i] for i in live], dtype=torch.int64, device=device)
        meta = PassMeta(cu_seqlens=packed([len(p) for p in parts], device),
                        read_slots=s if done else torch.full_like(s, -1), write_slots=s,
                        prefix_lens=torch.full_like(s, done), block_table=table[s])
        tokens = torch.tensor([t for p in parts for t in p], dtype=torch.int64, device=device)
        model(tokens, meta, pools, ops, picks=torch.zeros(0, dtype=torch.int64, device=device))
        done += chunk


@torch.no_grad()
def row_pass(model, ops, pools, table, rows, read_slots, doc_lens):
    """[T, d] final hidden states of every row token; `read_slots` may be any (strided) int64 view."""
    device = table.device
    meta = PassMeta(cu_seqlens=packed([len(r) for r in rows], device), read_slots=read_slots,
                    write_slots=torch.full(read_slots.shape, -1, dtype=torch.int64, device=device),
                    prefix_lens=doc_lens[read_slots], block_table=table[read_slots])
    tokens = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
    return model(tokens, meta, pools, ops)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are 0)."""
    ref, out = ref.double(), out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kev4b_heads_config():
    """Kev-4B's head counts and dims at a small width: the kernels compile for the served head
    shapes (once for the GPU tests and the benches) while the GEMMs stay cheap."""
    from random_models import tiny_config

    return tiny_config(hv_per_h=2, hidden_size=512, intermediate_size=1024, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128)


@contextlib.contextmanager
def fast_hot_autotuners():
    """The hot autotuners (name -> Autotuner) with fast benchmarks and their own caches, for a test
    module; their globals are put back afterwards."""
    import functools

    import pytest
    import triton

    from kev.ops.autotune import hot_autotuners

    with pytest.MonkeyPatch.context() as mp:
        tuners = hot_autotuners()
        for at in tuners.values():
            mp.setattr(at, "cache", at.cache)
            mp.setattr(at, "cache_results", at.cache_results)
            mp.setitem(at.__dict__, "do_bench", functools.partial(triton.testing.do_bench, warmup=1, rep=5))
        yield tuners


def stored_then_rows(model, named_ops, docs, write_slots, rows, read_slots, doc_lens, max_doc_tokens):
    """For each (name, ops): state-pass `docs` into `write_slots` of fresh strided pools (chunks of
    64 carried in the slot), then the row pass; asserts the row pass left the bank bit for bit as
    it was. Returns ({name: row outputs}, {name: pools})."""
    outs, banks = {}, {}
    for name, ops in named_ops:
        pools, table = make_pools(model.cfg, 4, max_doc_tokens, 16, torch.float32, "cpu", strided=True)
        state_pass(model, ops, pools, table, docs, write_slots, chunk=64)
        before = [t.clone() for t in pools.tensors()]
        outs[name] = row_pass(model, ops, pools, table, rows, read_slots, doc_lens)
        assert all(torch.equal(b, a) for b, a in zip(before, pools.tensors())), f"{name}: a row pass wrote the bank"
        banks[name] = pools
    return outs, banks


SPLIT_ATTENTION = {"paged_prefix_span", "paged_prefix_finish"}  # paged attention's split mode


def class_launches(cls, names) -> set[str]:
    """The hot kernels (of `names`) a pass of class `cls` launches: every one but paged
    attention's other mode (`kev.ops.attention.paged_prefix.split_mode`)."""
    from kev.ops.attention.paged_prefix import split_mode

    skip = {"paged_prefix_attention"} if split_mode(cls) else SPLIT_ATTENTION
    return set(names) - skip


def packed_chunks(lens, tokens: int, slots: int, block: int, entries: int):
    """`kev.exec.static_pass.packed_chunk_lists` as host int64 tensors, to set beside fla's:
    [entries, 2] (sequence, chunk) and [slots + 1]."""
    from kev.exec.static_pass import packed_chunk_lists

    pairs, offsets = packed_chunk_lists(lens, tokens, slots, block, entries)
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2), torch.tensor(offsets, dtype=torch.int64)
