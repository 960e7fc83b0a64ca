"""How far each non-GEMM kernel of a pass is from its memory floor, and from fla's kernel for the
same maths where fla has one.

The state pass's profile (`bench.state_pass --profile-out`) says where its non-GEMM time goes: the
delta rule, the norms, silu-mul, attention, the conv. This says how much of it better kernels
could win, and where to look first. Each kernel of one layer runs alone on the pass's tokens (new
documents, or with `--rows` question rows continuing stored states; Kev-4B's heads), timed as a
CUDA graph of `--reps` launches (no launch gaps), each after a read that flushes the L2 cache, whose
own time is taken off (`--warm-l2`: none; 13a81dc's figures had none, so its small shapes read
their inputs from L2), and is set against:
- its floor: the bytes it must read and write, at the best bandwidth a plain torch op reaches in
  the same run (`stream_gbps`: a device-to-device copy, or an add reading two tensors and writing a
  third, whichever is faster). The copy alone read 2,772 GB/s on the H200 (13a81dc), where our
  silu-mul moved 4,160: floors from it were half again too high;
- fla's kernel for the same maths, where fla has one. A library kernel faster than ours is a swap
  to make, not a kernel to write. fla is given what it needs in its own layout, made outside the
  timing (a contiguous copy where ours reads a column view): its time is a lower bound.
`per_pass_ms` is a kernel's time times its launches in a pass (`count`: per layer or per DeltaNet
layer). The GEMMs are not here: they run at 0.95 of the matmul floor (`state_pass.json`).

    python -m bench.kernel_floors --out bench/results/kernel_floors.json            # GPU, 16 x 2,048
    python -m bench.kernel_floors --seqs 63 --seq-tokens 32 --rows --out ...        # a loaded row pass
    python -m bench.kernel_floors --device cpu --config tiny --seqs 2 --seq-tokens 64 --reps 1 \\
        --out /tmp/kernel_floors.json   # the harness on the CPU, kernels interpreted (its test does this)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import KEV_4B, capture, cuda_ms, kev4b_config, run_info, write_json
from kev.model.config import ModelConfig

BF16, FP32 = 2, 4


@dataclass
class Case:
    name: str
    count: int  # launches in one pass of the model
    bytes: int  # what the kernel must read and write at least
    ours: Callable[[], object]
    fla: Callable[[], object] | None = None
    # (ours' result, fla's) -> the two tensors that should hold the same values: a check that both
    # compute the same maths (the max difference is recorded, not asserted: roundings differ)
    same: Callable[[object, object], tuple[torch.Tensor, torch.Tensor]] | None = None


def tiny_config() -> ModelConfig:
    """Kev-4B's head dims (the kernels' constexprs) at a small width: the harness on CPU."""
    return ModelConfig.from_dict(dict(KEV_4B, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      linear_num_key_heads=2, linear_num_value_heads=4))


def cases(cfg: ModelConfig, seqs: int, seq_tokens: int, device: str, rows: bool = False) -> list[Case]:
    """One layer's non-GEMM kernels on `seqs` sequences of `seq_tokens` tokens, inputs random: new
    documents (their states written to slots), or `rows` continuing the states in slots (written
    nowhere). A row reads what a document writes, so the byte floors are the same."""
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    from kev.ops.conv.indexed_conv import indexed_causal_conv
    from kev.ops.delta_rule.indexed_scan import indexed_scan
    from kev.ops.delta_rule.prep import CHUNK, delta_rule_inputs
    from kev.ops.fused.activations import silu_mul
    from kev.ops.fused.norms import add_rms_norm, gated_rms_norm
    from kev.ops.gates import DeltaGates

    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    T, N = seqs * seq_tokens, seqs
    D, I = cfg.hidden_size, cfg.intermediate_size
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    W = cfg.conv_kernel
    C = 2 * H * K + HV * V  # the conv's channels: q, k, v
    L, LD = cfg.num_layers, len(cfg.deltanet_layers)
    cu = torch.arange(0, T + 1, seq_tokens, device=device)
    chunks, offsets = prepare_chunk_indices(cu, CHUNK), prepare_chunk_offsets(cu, CHUNK)
    NT = chunks.shape[0]
    slots, none = torch.arange(N, device=device), torch.full((N,), -1, dtype=torch.int64, device=device)
    read, write = (slots, none) if rows else (none, slots)

    # the layer's fused input projection, as the model lays it out: q k v | z | a | b column views
    proj = rand(T, C + HV * V + 2 * HV)
    mixed, z = proj[:, :C], proj[:, C:C + HV * V]
    a, b = proj[:, C + HV * V:C + HV * V + HV], proj[:, C + HV * V + HV:]
    conv_w, conv_pool = rand(C, W, scale=0.5), rand(N + 1, C, W - 1)
    gates = DeltaGates(a=a, b=b, A_log=torch.rand(HV, generator=gen, device=device).log(),
                       dt_bias=rand(HV, dtype=torch.float32))
    state_pool = rand(N + 1, HV, K, V, dtype=torch.float32, scale=0.02)

    def conv():
        return indexed_causal_conv(x=mixed, weight=conv_w, cu_seqlens=cu, conv_pool=conv_pool, read_slots=read,
                                   write_slots=write, chunk_indices=chunks, split=2 * H * K)

    qk, v = conv()
    q, k, v = qk[:, :H * K].view(T, H, K), qk[:, H * K:].view(T, H, K), v.view(T, HV, V)

    def prep():
        return delta_rule_inputs(q, k, gates, cu, chunks)

    qn, kn, g, beta = prep()

    def intra():
        return chunk_gated_delta_rule_fwd_intra(k=kn[None], v=v[None], g=g[None], beta=beta[None], cu_seqlens=cu,
                                                chunk_size=CHUNK, chunk_indices=chunks)

    w, u, _ = intra()

    def scan():
        return indexed_scan(kn, w[0], u[0], g, cu, offsets, NT, state_pool, read, write)

    h, v_new = scan()

    def out():
        return chunk_fwd_o(q=qn[None], k=kn[None], v=v_new[None], h=h[None], g=g[None], scale=K ** -0.5,
                           cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=chunks)

    o = out()[0]
    norm_w, head_w = rand(D, scale=0.1), rand(V, scale=0.1)
    x, blk = rand(T, D), rand(T, D)
    gate_up = rand(T, 2 * I)
    z_heads = z.view(T, HV, V)

    # fla's kernels for the same maths, given their own layouts (made here, outside the timing)
    from fla.modules.activations.ops import swiglu_fwd
    from fla.modules.causal_conv1d.ops import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm as fla_rms_norm
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h

    mixed_c, z_rows, o_rows = mixed.contiguous()[None], z.reshape(T * HV, V), o.reshape(T * HV, V)
    cu_host = cu.cpu()  # fla's conv reads the lengths on the host: given, it need not sync to get them
    # fla's state kernel starts from a gathered copy of the rows' states (ours reads them in place);
    # its conv starts rows from zeros (timing only: the conv's cost does not depend on its start)
    start = state_pool[:N].clone() if rows else None
    gate_c, up_c = gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous()
    norm_w1 = (1 + norm_w.float()).to(norm_w.dtype)  # fla scales by the weight; Qwen3.5's norm by 1 + weight

    qk_bytes = 2 * T * H * K * BF16
    hv_bytes = T * HV * V * BF16  # one [T, HV, 128] bf16 tensor (w, u, v, v_new, o, z)
    g_bytes, h_bytes, pool_bytes = T * HV * FP32, NT * HV * K * V * BF16, N * HV * K * V * FP32
    return [
        Case("add_rms_norm", 2 * L, 4 * T * D * BF16, lambda: add_rms_norm(x, blk, norm_w, cfg.rms_norm_eps),
             lambda: fla_rms_norm(x, norm_w1, None, residual=blk, eps=cfg.rms_norm_eps, prenorm=True),
             lambda ours, fla: (ours[1], fla[0])),
        Case("silu_mul", L, 3 * T * I * BF16, lambda: silu_mul(gate_up[:, :I], gate_up[:, I:]),
             lambda: swiglu_fwd(gate_c, up_c), lambda ours, fla: (ours, fla)),
        Case("conv", LD, 2 * T * C * BF16 + N * C * (W - 1) * BF16, conv,
             lambda: causal_conv1d(x=mixed_c, weight=conv_w, activation="silu", cu_seqlens=cu,
                                   cu_seqlens_cpu=cu_host, output_final_state=not rows),
             None if rows else lambda ours, fla: (torch.cat(ours, dim=1), fla[0][0])),
        Case("delta_rule_prep", LD, 2 * qk_bytes + 2 * T * HV * BF16 + g_bytes + T * HV * BF16, prep),
        Case("delta_rule_intra (fla)", LD, qk_bytes // 2 + 3 * hv_bytes + g_bytes + T * HV * BF16, intra),
        Case("delta_rule_scan", LD, qk_bytes // 2 + 3 * hv_bytes + g_bytes + h_bytes + pool_bytes, scan,
             lambda: chunk_gated_delta_rule_fwd_h(k=kn[None], w=w, u=u, g=g[None], initial_state=start,
                                                  output_final_state=not rows, chunk_size=CHUNK, cu_seqlens=cu,
                                                  chunk_indices=chunks, chunk_offsets=offsets),
             lambda ours, fla: (ours[0], fla[0][0])),
        Case("delta_rule_o (fla)", LD, qk_bytes + 2 * hv_bytes + h_bytes + g_bytes, out),
        Case("gated_rms_norm", LD, 3 * hv_bytes, lambda: gated_rms_norm(o, z_heads, head_w, cfg.rms_norm_eps),
             lambda: rms_norm_gated(o_rows, z_rows, head_w, None, activation="swish", eps=cfg.rms_norm_eps),
             lambda ours, fla: (ours.reshape(fla.shape), fla)),
    ]


def time_ms(fn: Callable[[], object], reps: int, device: str, flush: Callable[[], object] | None = None
            ) -> tuple[float, bool]:
    """(ms a call, whether from a CUDA graph). On CUDA `reps` calls are captured in one graph after
    warm calls (compiles, autotunes: `bench.common.capture`); a call that cannot be captured (a host
    sync inside) is timed eagerly between events instead, launch gaps included. With `flush`, each
    call follows a flush of the L2 cache, and a graph of the flushes alone is timed and taken off:
    a small pass's inputs (a few MB) would otherwise stay in L2 from one replay to the next and beat
    the DRAM floor. On CPU: wall time (the harness only)."""

    def calls(with_fn=True):
        def run():
            for _ in range(reps):
                if flush is not None:
                    flush()
                if with_fn:
                    fn()  # each result dropped at once: the graph's pool reuses its memory
        return run

    if device != "cuda":
        fn()
        start = time.perf_counter()
        calls()()
        return (time.perf_counter() - start) * 1e3 / reps, False
    flushes_ms = 0.0
    try:
        graph, _ = capture(calls())
        graph.replay()
        total = cuda_ms(graph.replay, 1)[0]
        if flush is not None:
            flush_graph, _ = capture(calls(with_fn=False))
            flush_graph.replay()
            flushes_ms = cuda_ms(flush_graph.replay, 1)[0]
        return (total - flushes_ms) / reps, True
    except Exception:  # noqa: BLE001 - a kernel that syncs with the host inside: time it eagerly
        torch.cuda.synchronize()
        if flush is not None:
            flushes_ms = cuda_ms(calls(with_fn=False), 1)[0]
        return (cuda_ms(calls(), 1)[0] - flushes_ms) / reps, False


def l2_flush(device: str) -> Callable[[], object] | None:
    """A read of twice the GPU's L2 cache (the H200's is 60 MB) that leaves none of a kernel's inputs
    there; None on CPU. A read, not a write: written lines would be written back to DRAM while the
    timed kernel runs, on its bandwidth."""
    if device != "cuda":
        return None
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    scratch = torch.ones(max(2 * l2, 1 << 20) // 4, dtype=torch.float32, device=device)
    total = torch.empty((), dtype=torch.float32, device=device)
    return lambda: torch.sum(scratch, dim=0, out=total)


def stream_gbps(device: str, nbytes: int = 1 << 30) -> dict[str, float]:
    """Bandwidth (bytes read + written a second, GB/s) of a device-to-device copy of `nbytes` and of
    an add of two such tensors into a third; `best` is the floors' bandwidth."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    b, c = torch.empty_like(a), torch.empty_like(a)
    copy_ms, _ = time_ms(lambda: c.copy_(a), 10, device)
    add_ms, _ = time_ms(lambda: torch.add(a, b, out=c), 10, device)
    got = {"copy": 2 * nbytes / (copy_ms * 1e-3) / 1e9, "add": 3 * nbytes / (add_ms * 1e-3) / 1e9}
    return {**got, "best": max(got.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernel_floors.json")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--seq-tokens", type=int, default=2048)
    ap.add_argument("--rows", action="store_true", help="the sequences continue stored states (question rows)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", choices=("kev-4b", "tiny"), default="kev-4b")
    ap.add_argument("--warm-l2", action="store_true",
                    help="no L2 flush before each call (13a81dc's figures were taken so: small shapes ran from L2)")
    args = ap.parse_args()
    cfg = kev4b_config() if args.config == "kev-4b" else tiny_config()
    bandwidth = stream_gbps(args.device, 1 << 30 if args.device == "cuda" else 1 << 20)
    gbps = bandwidth["best"]
    flush = None if args.warm_l2 else l2_flush(args.device)
    results = []
    with torch.no_grad():
        for case in cases(cfg, args.seqs, args.seq_tokens, args.device, rows=args.rows):
            ms, graphed = time_ms(case.ours, args.reps, args.device, flush)
            floor = case.bytes / (gbps * 1e9) * 1e3
            row = dict(kernel=case.name, count=case.count, ms=ms, graphed=graphed, floor_ms=floor,
                       of_bandwidth=floor / ms, per_pass_ms=ms * case.count, bytes=case.bytes)
            if case.fla is not None:
                try:
                    fla_ms, fla_graphed = time_ms(case.fla, args.reps, args.device, flush)
                    row.update(fla_ms=fla_ms, fla_graphed=fla_graphed, ours_over_fla=ms / fla_ms)
                    if case.same is not None:
                        a, b = case.same(case.ours(), case.fla())
                        row["max_abs_vs_fla"] = (a.float() - b.float()).abs().max().item()
                except Exception as e:  # noqa: BLE001 - fla's signature or layout differs: say so, go on
                    row.update(fla_error=f"{type(e).__name__}: {e}"[:300])
            results.append(row)
            print(f"{case.name:24s} {ms:8.3f} ms (x{case.count}: {ms * case.count:7.2f})  floor {floor:7.3f} "
                  f"({floor / ms:4.0%} of bandwidth)" + (f"  fla {row['fla_ms']:8.3f}" if "fla_ms" in row else
                                                         "  fla -" if case.fla is None else "  fla error"))
    result = {**run_info(), "model": args.config, "rows": args.rows, "seqs": args.seqs,
              "seq_tokens": args.seq_tokens, "tokens": args.seqs * args.seq_tokens, "reps": args.reps,
              "l2_flushed": flush is not None,
              "stream_gbps": gbps, "copy_gbps": bandwidth["copy"],
              "add_gbps": bandwidth["add"], "kernels": results,
              "per_pass_ms": sum(r["per_pass_ms"] for r in results),
              "per_pass_floor_ms": sum(r["floor_ms"] * r["count"] for r in results)}
    write_json(args.out, result)


if __name__ == "__main__":
    main()
