"""Compiles the project's own Triton kernels for sm_90 on a machine without a GPU and prints, as one
JSON line, {kernel name: cubin bytes}. Run by tests/ops/test_kernels_interpret.py
(`test_kernels_compile_for_hopper`) in a process of its own.

Each kernel is called through its public launcher, as serving calls it (Kev-4B head dims, bf16
activations, fp32 states, one config), against a stand-in driver that reports a Hopper GPU; Triton's
JIT cache hook gets each launch's specialization, compiles it to a cubin with the bundled ptxas, and
skips the launch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interpret_support import FakeHopper  # noqa: E402

from kev.ops.attention import paged_prefix  # noqa: E402
from kev.ops.conv import indexed_conv  # noqa: E402
from kev.ops.delta_rule import indexed_scan, scan_output  # noqa: E402


def main() -> None:
    driver.set_active(FakeHopper())
    compiled: dict[str, int] = {}

    def compile_instead(*, fn, compile, **_):
        src = fn.jit_function.ASTSource(fn.jit_function, compile["signature"], compile["constants"],
                                        compile["configs"][0])
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=compile["num_warps"], num_stages=compile["num_stages"]))
        compiled[fn.name] = len(kernel.asm["cubin"])
        return True  # nothing to launch it on

    knobs.runtime.jit_cache_hook = compile_instead
    H, HV, K, V, HQ, HKV, D, BS, N, L, S = 16, 32, 128, 128, 16, 4, 256, 64, 3, 70, 4
    T, C = N * L, 2 * H * K + HV * V
    bf = dict(dtype=torch.bfloat16)
    cu = torch.arange(N + 1) * L
    read, write = torch.tensor([0, -1, 2]), torch.tensor([-1, 1, -1])
    nc = -(-L // 64)
    chunks = torch.stack([torch.arange(N).repeat_interleave(nc), torch.arange(nc).repeat(N)], 1)
    offsets = torch.arange(N + 1) * nc
    indexed_conv.indexed_causal_conv(x=torch.randn(T, C + 8, **bf)[:, :C], weight=torch.randn(C, 4, **bf),
                                     cu_seqlens=cu, conv_pool=torch.zeros(S, C, 3, **bf), read_slots=read,
                                     write_slots=write, chunk_indices=chunks, split=2 * H * K,
                                     config=indexed_conv.CONV_CONFIGS[0])
    indexed_scan.l2norm_heads(torch.randn(T, 2 * H, K, **bf), blocks=2, config=indexed_scan.L2NORM_CONFIGS[0])
    q, k, w = (torch.randn(T, n, K, **bf) for n in (H, H, HV))
    u, g, pool = torch.randn(T, HV, V, **bf), torch.randn(T, HV), torch.zeros(S, HV, K, V)
    indexed_scan.indexed_scan(k, w, u, g, cu, offsets, int(offsets[-1]), pool, read, write,
                              config=indexed_scan.SCAN_CONFIGS[0])
    scan_output.indexed_scan_output(q, k, w, u, g, cu, pool, read, write, K ** -0.5,
                                    config=scan_output.SCAN_OUTPUT_CONFIGS[0])
    block = paged_prefix.query_block(HQ // HKV)
    nb = -(-L // block)
    attn_chunks = torch.stack([torch.arange(N).repeat_interleave(nb), torch.arange(nb).repeat(N)], 1)
    for split in (False, True):
        paged_prefix.paged_prefix_attention(
            q=torch.randn(T, HQ, D, **bf), k=torch.randn(T, HKV, D, **bf), v=torch.randn(T, HKV, D, **bf),
            cu_seqlens=cu, prefix_lens=torch.tensor([5, 0, 300]), key_pages=torch.zeros(S * 8, BS, HKV, D, **bf),
            value_pages=torch.zeros(S * 8, BS, HKV, D, **bf), block_table=torch.zeros(N, 8, dtype=torch.int32),
            write_slots=write, chunk_indices=attn_chunks, config=paged_prefix.ATTN_CONFIGS[0], split=split)
    print(json.dumps(compiled))


if __name__ == "__main__":
    main()
