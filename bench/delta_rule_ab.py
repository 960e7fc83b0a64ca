"""The delta rule's two output paths side by side, one DeltaNet layer at Kev-4B heads (16 key, 32 value
heads, K = V = 128, bf16), per pass shape:

- split: the indexed scan stores every chunk's start state (`h`) and the corrected values, then
  fla's `chunk_fwd_o` reads them back to form the output (what serving runs by default);
- output_in_scan: the scan's own kernel forms each chunk's output (`kev.ops.delta_rule.scan_output`)
  and writes neither; a row's last chunk skips the state update it would throw away.

The whole `indexed_chunk_gated_delta_rule` call is timed (the L2 norm, cumsum and WY pieces are the
same in both), and the part that differs alone (the state kernel and `chunk_fwd_o`, against the
fused kernel, on the same inputs; and the state kernel by itself). Each is captured in a CUDA graph
of CALLS calls and timed by replay, after every autotuned kernel was tuned on that shape alone
(fla's `chunk_fwd_o` keys omit the token count: its cache is cleared per shape). Rows read bank slots and write none; documents start from zeros and write their
slots. Shapes: each shape class's tuning shapes (`kev.ops.shapes.CLASS_SHAPES`, rows at 40 tokens)
and wider ones on both sides of the classes' bounds, none taken from a load workload.
Also: every `SCAN_OUTPUT_CONFIGS` config is bit-identical on each shape, and the two paths' outputs
and written states agree (relative error).

    python -m bench.delta_rule_ab --out bench/results/delta_rule_ab.json
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import capture, cuda_ms, kev4b_config, run_info, write_json
from kev.ops.autotune import hot_autotuners
from fla.ops.common.chunk_o import chunk_fwd_o
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

from kev.ops.delta_rule import scan_output
from kev.ops.delta_rule.indexed_scan import CHUNK, indexed_chunk_gated_delta_rule, indexed_scan
from kev.ops.delta_rule.prep import delta_rule_inputs
from kev.ops.gates import DeltaGates
from kev.ops.shapes import CLASS_SHAPES, classify

DEVICE = "cuda"
CALLS = 10  # calls per captured graph
POOL_SLOTS = 16
# (kind, sequences, tokens each): the class shapes' sequence counts and lengths, then wider passes,
# and rows over two chunks (the only rows that run the fused kernel's state update: where it faulted)
EXTRA_SHAPES = [("rows", 6, 32), ("rows", 96, 64), ("rows", 128, 20), ("rows", 32, 100), ("docs", 12, 48),
                ("docs", 16, 2048)]


def shapes() -> list[tuple[str, int, int]]:
    out = [("rows" if cls.rows else "docs", s.seqs, s.tokens) for cls, group in CLASS_SHAPES.items() for s in group]
    return list(dict.fromkeys(out + EXTRA_SHAPES))


def inputs(cfg, kind: str, seqs: int, tokens: int, gen) -> dict:
    H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    T = seqs * tokens
    dev = dict(device=DEVICE, generator=gen)
    qkv = torch.randn(T, 2 * H * K + HV * V, **dev).bfloat16()  # packed like the model's conv output
    as_long = dict(dtype=torch.int64, device=DEVICE)
    if kind == "rows":
        read = torch.randint(0, POOL_SLOTS, (seqs,), **as_long)
        write = torch.full((seqs,), -1, **as_long)
    else:
        read = torch.full((seqs,), -1, **as_long)
        write = torch.arange(seqs, **as_long) % POOL_SLOTS  # repeats when seqs > POOL_SLOTS: same work
        if seqs > POOL_SLOTS:
            write[POOL_SLOTS:] = -1
    return dict(q=qkv[:, :H * K].unflatten(1, (H, K)), k=qkv[:, H * K:2 * H * K].unflatten(1, (H, K)),
                v=qkv[:, 2 * H * K:].unflatten(1, (HV, V)),
                g=-torch.rand(T, HV, **dev) * 0.2, beta=torch.rand(T, HV, **dev).bfloat16(),
                cu=torch.arange(seqs + 1, **as_long) * tokens,
                pool=torch.randn(POOL_SLOTS, HV, K, V, **dev) * 0.05, read=read, write=write)


def run(x: dict, pool: torch.Tensor, output_in_scan: bool, config=None) -> torch.Tensor:
    return indexed_chunk_gated_delta_rule(q=x["q"], k=x["k"], v=x["v"], gates=DeltaGates.given(x["g"], x["beta"]),
                                          cu_seqlens=x["cu"],
                                          state_pool=pool, read_slots=x["read"], write_slots=x["write"],
                                          output_in_scan=output_in_scan, scan_config=config)


def graph_us(fn) -> float:
    graph, _ = capture(lambda: [fn() for _ in range(CALLS)])
    graph.replay()
    return statistics.median(cuda_ms(graph.replay, 15)) * 1e3 / CALLS


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    return ((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def parts_us(x: dict) -> dict:
    """The part that differs alone, from the same w, u and g: the state kernel then fla's
    `chunk_fwd_o` (split), against the state kernel that forms the output (fused)."""
    cu = x["cu"]
    chunks, offsets = prepare_chunk_indices(cu, CHUNK), prepare_chunk_offsets(cu, CHUNK)
    q, k, g, beta = delta_rule_inputs(x["q"], x["k"], DeltaGates.given(x["g"], x["beta"]), cu, chunks)
    g = g[None]
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k[None], v=x["v"].contiguous()[None], g=g, beta=beta[None],
                                               cu_seqlens=cu, chunk_size=CHUNK, chunk_indices=chunks)
    w, u, g = w[0], u[0], g[0]
    HV, K, V = w.shape[1], w.shape[2], u.shape[2]
    scale, pool = K ** -0.5, x["pool"].clone()
    h = k.new_empty(chunks.shape[0], HV, K, V)
    v_new = torch.empty_like(u)

    def split():
        indexed_scan(k, w, u, g, cu, offsets, chunks.shape[0], pool, x["read"], x["write"], h=h, v_new=v_new)
        chunk_fwd_o(q=q[None], k=k[None], v=v_new[None], h=h[None], g=g[None], scale=scale, cu_seqlens=cu,
                    chunk_size=CHUNK, chunk_indices=chunks)

    def fused():
        scan_output.indexed_scan_output(q, k, w, u, g, cu, pool, x["read"], x["write"], scale)

    def scan_alone():
        indexed_scan(k, w, u, g, cu, offsets, chunks.shape[0], pool, x["read"], x["write"], h=h, v_new=v_new)

    out = {"split_parts_us": graph_us(split), "fused_part_us": graph_us(fused), "scan_alone_us": graph_us(scan_alone)}
    out["fused_over_split_parts"] = out["fused_part_us"] / out["split_parts_us"]
    return out


def case(cfg, kind: str, seqs: int, tokens: int, gen) -> dict:
    x = inputs(cfg, kind, seqs, tokens, gen)
    for tuner in hot_autotuners().values():  # tuned on this shape alone
        tuner.cache.clear()
    out = {"kind": kind, "seqs": seqs, "tokens": tokens,
           "shape_class": classify(seqs * tokens, rows=kind == "rows").value}
    results = {}
    for name, in_scan in (("split", False), ("output_in_scan", True)):
        pool = x["pool"].clone()
        results[name] = (run(x, pool, in_scan), pool)
        timing_pool = x["pool"].clone()
        out[f"{name}_us"] = graph_us(lambda: run(x, timing_pool, in_scan))
    out["in_scan_over_split"] = out["output_in_scan_us"] / out["split_us"]
    out.update(parts_us(x))
    (o_split, p_split), (o_fused, p_fused) = results["split"], results["output_in_scan"]
    out["rel_err_output"] = rel_err(o_split, o_fused)
    out["rel_err_states"] = rel_err(p_split, p_fused) if kind == "docs" else 0.0
    first = None
    for config in scan_output.SCAN_OUTPUT_CONFIGS:
        pool = x["pool"].clone()
        got = (run(x, pool, True, config), pool)
        if first is None:
            first = got
        elif not all(torch.equal(a, b) for a, b in zip(first, got)):
            out.setdefault("configs_differ", []).append(str(config))
    out["configs_bit_identical"] = "configs_differ" not in out
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/delta_rule_ab.json")
    args = ap.parse_args()
    cfg = kev4b_config()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    result = {**run_info(), "calls_per_graph": CALLS, "cases": []}
    for kind, seqs, tokens in shapes():
        entry = case(cfg, kind, seqs, tokens, gen)
        result["cases"].append(entry)
        print(f"{kind} {seqs}x{tokens} ({entry['shape_class']}): split {entry['split_us']:.1f} us, output in scan "
              f"{entry['output_in_scan_us']:.1f} us ({entry['in_scan_over_split']:.3f}x; the part that differs: "
              f"{entry['split_parts_us']:.1f} -> {entry['fused_part_us']:.1f} us, the state kernel alone "
              f"{entry['scan_alone_us']:.1f}); rel err output "
              f"{entry['rel_err_output']:.1e}, states {entry['rel_err_states']:.1e}; configs bit-identical "
              f"{entry['configs_bit_identical']}", flush=True)
        torch.cuda.empty_cache()
    by_class: dict[str, list[float]] = {}
    for entry in result["cases"]:
        by_class.setdefault(entry["shape_class"], []).append(entry["in_scan_over_split"])
    result["in_scan_over_split_by_class"] = {c: max(r) for c, r in by_class.items()}  # the worst shape of each
    write_json(args.out, result)


if __name__ == "__main__":
    main()
