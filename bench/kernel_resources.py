"""The project's own Triton kernels compiled for sm_90 on a machine without a GPU: registers and
spills per config, read off the cubins Triton's bundled ptxas makes.

Each kernel is called through its public launcher, as serving calls it (Kev-4B head dims, bf16
activations, fp32 states), once per config, against a stand-in driver that reports a Hopper GPU.
Triton's JIT cache hook gets each launch's specialization, compiles it to a cubin, and skips the
launch; `cuobjdump --dump-resource-usage` then gives the registers a thread and the stack (spills).
A config that spills much is unlikely to be the fastest, but only a GPU can say: this chooses which
configs the autotuner measures, never which one serves. tests/ops/test_kernels_interpret.py runs it
with `--first` (one config each): every kernel still compiles for Hopper.

    python -m bench.kernel_resources            # every config of every kernel (~2 s a compile, cold)
    python -m bench.kernel_resources --first --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Callable

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver


H, HV, K, V, HQ, HKV, D, BS = 16, 32, 128, 128, 16, 4, 256, 64  # Kev-4B's heads
N, L, S = 3, 70, 4  # sequences of 70 tokens (two delta-rule chunks), pool slots


class HopperDriver:
    """A driver stand-in: Triton's JIT front end specialises and keys kernels for sm_90."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def launchers() -> dict[str, tuple[list, Callable]]:
    """kernel name -> (its configs, launch(config)): each launch as serving makes it."""
    # imported here, not at the top: the tests take their stand-in driver (`HopperDriver`) from
    # this module, and importing it must not import the kernels (decorated at import, compiled or
    # interpreted as the environment says then)
    from kev.ops.attention import paged_prefix
    from kev.ops.conv import indexed_conv
    from kev.ops.delta_rule import indexed_scan, prep
    from kev.ops.fused import activations, norms
    from kev.ops.gates import DeltaGates

    T, C = N * L, 2 * H * K + HV * V
    bf = dict(dtype=torch.bfloat16)
    cu = torch.arange(N + 1) * L
    read, write = torch.tensor([0, -1, 2]), torch.tensor([-1, 1, -1])
    nc = -(-L // 64)
    chunks = torch.stack([torch.arange(N).repeat_interleave(nc), torch.arange(nc).repeat(N)], 1)
    offsets = torch.arange(N + 1) * nc
    x, weight, conv_pool = torch.randn(T, C + 8, **bf)[:, :C], torch.randn(C, 4, **bf), torch.zeros(S, C, 3, **bf)
    k, w = (torch.randn(T, n, K, **bf) for n in (H, HV))
    u, g, pool = torch.randn(T, HV, V, **bf), torch.randn(T, HV), torch.zeros(S, HV, K, V)
    qa, ka, va = torch.randn(T, HQ, D, **bf), torch.randn(T, HKV, D, **bf), torch.randn(T, HKV, D, **bf)
    pages = torch.zeros(S * 8, BS, HKV, D, **bf)
    nb = -(-L // paged_prefix.query_block(HQ // HKV))
    attn_chunks = torch.stack([torch.arange(N).repeat_interleave(nb), torch.arange(nb).repeat(N)], 1)
    attn_configs = paged_prefix.valid_configs(paged_prefix.ATTN_CONFIGS, {}, BD=D)

    def attention(config, split):
        paged_prefix.paged_prefix_attention(
            q=qa, k=ka, v=va, cu_seqlens=cu, prefix_lens=torch.tensor([5, 0, 300]), key_pages=pages,
            value_pages=pages.clone(), block_table=torch.zeros(N, 8, dtype=torch.int32), write_slots=write,
            chunk_indices=attn_chunks, config=config, split=split,
            gate=torch.randn(T, HQ, 2 * D, **bf)[..., D:])  # the output gate, a view of the q projection

    hidden, mlp, rope = 2560, 9216, 64
    x2, h2, wn = torch.randn(T, hidden, **bf), torch.randn(T, hidden, **bf), torch.randn(hidden, **bf)
    cos, sin = torch.randn(T, rope, **bf), torch.randn(T, rope, **bf)
    gate_up = torch.randn(T, 2 * mlp, **bf)
    qk, ab = torch.randn(T, 2 * H, K, **bf), torch.randn(T, 2 * HV + 64, **bf)  # (the projection's other columns)
    one = [None]  # the fused kernels pick their blocks from the shape: nothing to tune
    return {
        "rms_norm": (one, lambda c: norms.rms_norm(x2, wn, 1e-6)),
        "add_rms_norm": (one, lambda c: norms.add_rms_norm(x2, h2, wn, 1e-6)),
        "rms_norm_rope": (one, lambda c: norms.rms_norm_rope(qa, torch.randn(D, **bf), 1e-6, cos, sin)),
        "gated_rms_norm": (one, lambda c: norms.gated_rms_norm(u, torch.randn(T, HV, V, **bf),
                                                                 torch.randn(V, **bf), 1e-6)),
        "silu_mul": (one, lambda c: activations.silu_mul(gate_up[:, :mlp], gate_up[:, mlp:])),
        "sigmoid_mul": (one, lambda c: activations.sigmoid_mul(qa, torch.randn(T, HQ, D, **bf))),
        "indexed_conv": (indexed_conv.CONV_CONFIGS, lambda c: indexed_conv.indexed_causal_conv(
            x=x, weight=weight, cu_seqlens=cu, conv_pool=conv_pool, read_slots=read, write_slots=write,
            chunk_indices=chunks, split=2 * H * K, config=c)),
        "delta_rule_prep": (one, lambda c: prep.delta_rule_inputs(  # q, k column views of the conv's block
            qk[:, :H], qk[:, H:], DeltaGates(ab[:, :HV], ab[:, HV:2 * HV], torch.randn(HV), torch.randn(HV)),
            cu, chunks)),
        "indexed_scan": (indexed_scan.SCAN_CONFIGS, lambda c: indexed_scan.indexed_scan(
            k, w, u, g, cu, offsets, int(offsets[-1]), pool, read, write, config=c)),
        "paged_prefix_attention": (attn_configs, lambda c: attention(c, False)),
        "paged_prefix_split": (attn_configs, lambda c: attention(c, True)),  # the span and finish kernels
        "paged_store": (one, lambda c: paged_prefix.paged_store(  # a state pass's last attention layer
            ka, va, cu, torch.tensor([5, 0, 300]), pages, pages.clone(), torch.zeros(N, 8, dtype=torch.int32), write,
            chunk_indices=attn_chunks, group=HQ // HKV)),
    }


def resources(cubin: bytes) -> dict[str, int]:
    """{'REG': registers a thread, 'STACK': bytes of stack a thread (spills), ...} of a cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((ln for ln in text.splitlines() if "REG:" in ln), "")
    return {k: int(v) for k, v in (part.split(":", 1) for part in line.split() if ":" in part)
            if v.isdigit()}


def pdl_wait_first(ptx: str) -> bool:
    """Whether the kernel waits for the one before it (`griddepcontrol.wait`, kev/ops/pdl.py) before
    its first global memory access."""
    lines = ptx.splitlines()
    wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
    memory = next((i for i, ln in enumerate(lines) if any(op in ln for op in ("ld.global", "st.global", "atom.",
                                                                              "red.", "cp.async"))), len(lines))
    return wait is not None and wait < memory


def survey(first_only: bool = False, with_pdl: bool = False) -> list[dict]:
    """Compile every (or each kernel's first) config; one entry per compiled Triton function. With
    `with_pdl` the launches ask for programmatic dependent launch (off by default, kev/ops/pdl.py)."""
    from kev.ops import pdl

    found: list[dict] = []
    current: dict = {}

    def compile_instead(*, fn, compile, **_):
        jit = fn.jit_function
        src = jit.ASTSource(jit, compile["signature"], compile["constants"], compile["configs"][0])
        pdl = "USE_PDL" in jit.arg_names and compile["constants"].get((jit.arg_names.index("USE_PDL"),), False)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=compile["num_warps"], num_stages=compile["num_stages"],
                                             launch_pdl=pdl))
        found.append({**current, "function": fn.name, "cubin_bytes": len(kernel.asm["cubin"]),
                      "pdl_wait_first": pdl_wait_first(kernel.asm["ptx"]), **resources(kernel.asm["cubin"])})
        return True  # nothing to launch it on

    kernels = launchers()  # imports fla and the kernels first: fla probes the device at import
    previous = driver._active  # not reset_active(): with no GPU there is no default driver to make
    driver.set_active(HopperDriver())
    knobs.runtime.jit_cache_hook = compile_instead
    pdl_before, pdl.on = pdl.on, with_pdl
    try:
        for name, (configs, launch) in kernels.items():
            for config in configs[:1] if first_only else configs:
                current = {"kernel": name, "config": "blocks from the shape" if config is None else str(config)}
                launch(config)
    finally:
        knobs.runtime.jit_cache_hook = None
        driver.set_active(previous)
        pdl.on = pdl_before
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", action="store_true", help="each kernel's first config only")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    ap.add_argument("--pdl", action="store_true", help="launch as with PDL on (kev/ops/pdl.py): its wait in place")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    found = survey(args.first, args.pdl)
    if args.json:
        print(json.dumps(found))
        return
    for e in found:
        print(f"{e['kernel']:24} {e['function']:30} {e['config']:70} registers {e.get('REG', '?'):>3}, "
              f"stack {e.get('STACK', '?'):>5} bytes")


if __name__ == "__main__":
    main()
