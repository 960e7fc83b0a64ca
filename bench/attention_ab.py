"""Paged attention side by side, on Kev-4B heads (16 query heads, 4 kv heads, head dim 256, bf16).

1. New documents: a state pass has no prefix, so its attention is plain causal attention over
   each document. `paged_prefix_attention` at every config (it also stores the documents' K/V
   into pages) against `torch.nn.functional.scaled_dot_product_attention(is_causal=True,
   enable_gqa=True)` on the documents as a [docs, heads, tokens, dim] view, with the flash and the
   cuDNN backends each, plus the page store it would then need (`index_copy_` of K and V into the
   pages).
2. Rows over stored documents: the one-program kernel against split mode (a program per prefix
   span, then the finish kernel), every config of each; split mode also at SPAN_COUNTS spans and
   at SPLIT_BLOCK_M query tokens a program.
3. Other tiles (`TILES`: query tokens a program, keys a step) for new documents and for the
   one-program kernel over stored ones, every config of each (a config that cannot compile or fit is
   reported): at head dim 256 serving runs 16 tokens x 4 heads against 32 keys a step, its key tile
   fixed because the online softmax's order follows it. A larger tile changes the output's last
   bits (the relative error against the served tile is recorded), so it would be a change of the
   head dim's fixed tile, for every pass alike, not a config.
Each candidate is captured in a CUDA graph (10 calls) and timed by replay, so host work is not
in the figures. Outputs are compared (relative error).

    python -m bench.attention_ab --out bench/results/attention_ab.json
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from fla.ops.utils.index import prepare_chunk_indices
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import capture, cuda_ms, kev4b_config, run_info, write_json
from kev.ops.attention import paged_prefix

DEVICE = "cuda"
BS = 64  # K/V page size
SHAPES = [(1, 2208), (6, 2208), (16, 2048)]  # (documents, tokens each)
# (rows, tokens each, prefix tokens): rows_few's shapes (split mode serves them) and a wider one
ROW_SHAPES = [(1, 16, 2200), (6, 32, 48), (5, 32, 2200), (8, 64, 2200)]
CALLS = 10  # calls per captured graph
SPAN_COUNTS = (4, 16, 32)  # split mode's span counts timed beside PREFIX_SPANS
SPLIT_BLOCK_M = (8,)  # split mode's query tokens a program timed beside query_block (16 at Kev-4B's 4 heads a group)
TILES = ((16, 64), (32, 32), (32, 64))  # (query tokens a program, keys a step) timed beside the served (16, 32)


def graph_us(fn) -> float:
    """Median microseconds of one call, from replays of a graph of CALLS calls."""
    graph, _ = capture(lambda: [fn() for _ in range(CALLS)])
    graph.replay()
    return statistics.median(cuda_ms(graph.replay, 15)) * 1e3 / CALLS


def other_tiles(run, configs, ref) -> dict:
    """`run(config, block_m, block_n)` at each of TILES, every config: its best, and the relative
    error of its first working config's output against `ref` (the served tile's)."""
    out = {}
    for block_m, block_n in TILES:
        us, failed, err = {}, {}, None
        for c in configs:
            try:
                us[str(c)] = graph_us(lambda c=c: run(c, block_m, block_n))
                if err is None:
                    got = run(c, block_m, block_n).float()
                    err = ((got - ref).norm() / ref.norm()).item()
            except Exception as e:  # noqa: BLE001 - a config that cannot compile or fit this tile is a result
                failed[str(c)] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        best = min(us, key=us.get) if us else None
        out[f"{block_m}x{block_n}"] = {"best_us": us.get(best), "best_config": best, "configs_us": us,
                                       "failed": failed, "rel_err_vs_served_tile": err}
    return out


def case(cfg, docs: int, tokens: int, gen) -> dict:
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = docs * tokens
    dev = dict(device=DEVICE, generator=gen)
    q = torch.randn(T, Hq, D, **dev).bfloat16()
    k, v = (torch.randn(T, Hkv, D, **dev).bfloat16() for _ in range(2))
    per = -(-tokens // BS)
    key_pages = torch.zeros(docs * per, BS, Hkv, D, device=DEVICE, dtype=torch.bfloat16)
    value_pages = torch.zeros_like(key_pages)
    as_long = dict(dtype=torch.int64, device=DEVICE)
    table = torch.arange(docs * per, dtype=torch.int32, device=DEVICE).view(docs, per)
    cu = torch.arange(docs + 1, **as_long) * tokens
    zeros, slots = torch.zeros(docs, **as_long), torch.arange(docs, **as_long)
    served = paged_prefix.query_block(Hq // Hkv)
    # made here, not inside the captured calls (fla builds them on the host)
    chunks_by_block = {m: prepare_chunk_indices(cu, m) for m in (served, *(m for m, _ in TILES))}

    def paged(config, block_m=None, block_n=None):
        return paged_prefix.paged_prefix_attention(
            q=q, k=k, v=v, cu_seqlens=cu, prefix_lens=zeros, key_pages=key_pages, value_pages=value_pages,
            block_table=table, write_slots=slots, config=config, block_m=block_m, block_n=block_n,
            chunk_indices=chunks_by_block[block_m or served])

    # token t of document n lives at page table[n, t // BS], row t % BS: with these tables, flat page rows
    page_rows = (table.long()[:, :, None] * BS + torch.arange(BS, device=DEVICE)).flatten(1)[:, :tokens].flatten()

    def sdpa(backend):
        qd = q.view(docs, tokens, Hq, D).transpose(1, 2)
        kd, vd = (t.view(docs, tokens, Hkv, D).transpose(1, 2) for t in (k, v))
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        key_pages.view(-1, Hkv, D).index_copy_(0, page_rows, k)
        value_pages.view(-1, Hkv, D).index_copy_(0, page_rows, v)
        return o.transpose(1, 2).reshape(T, Hq, D)

    out = {"docs": docs, "tokens": tokens,
           "causal_tflop": 2 * 2 * docs * tokens * (tokens + 1) / 2 * Hq * D / 1e12}
    paged_us = {str(c): graph_us(lambda c=c: paged(c)) for c in paged_prefix.ATTN_CONFIGS
                if paged_prefix.valid_configs([c], {}, BD=max(32, D))}
    best = min(paged_us, key=paged_us.get)
    out["paged_us"], out["paged_best_config"], out["paged_configs_us"] = paged_us[best], best, paged_us
    ref = paged(paged_prefix.ATTN_CONFIGS[0]).float()
    for label, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            out[f"sdpa_{label}_us"] = graph_us(lambda: sdpa(backend))
            out[f"sdpa_{label}_rel_err_vs_paged"] = ((sdpa(backend).float() - ref).norm() / ref.norm()).item()
            out[f"paged_over_sdpa_{label}"] = out["paged_us"] / out[f"sdpa_{label}_us"]
        except RuntimeError as e:  # no such kernel for this shape / GPU
            out[f"sdpa_{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for name in ("paged_us", "sdpa_flash_us", "sdpa_cudnn_us"):
        if name in out:
            out[name.replace("_us", "_tflops")] = out["causal_tflop"] / (out[name] * 1e-6)
    configs = [c for c in paged_prefix.ATTN_CONFIGS if paged_prefix.valid_configs([c], {}, BD=max(32, D))]
    out["tiles"] = other_tiles(paged, configs, ref)
    for entry in out["tiles"].values():
        if entry["best_us"]:
            entry["tflops"] = out["causal_tflop"] / (entry["best_us"] * 1e-6)
    return out


def row_case(cfg, rows: int, tokens: int, prefix: int, gen) -> dict:
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    T = rows * tokens
    dev = dict(device=DEVICE, generator=gen)
    q = torch.randn(T, Hq, D, **dev).bfloat16()
    k, v = (torch.randn(T, Hkv, D, **dev).bfloat16() for _ in range(2))
    per = -(-(prefix + tokens) // BS)
    key_pages = (torch.randn(rows * per, BS, Hkv, D, **dev) * 0.5).bfloat16()
    value_pages = torch.randn(rows * per, BS, Hkv, D, **dev).bfloat16()
    as_long = dict(dtype=torch.int64, device=DEVICE)
    table = torch.randperm(rows * per, device=DEVICE).to(torch.int32).view(rows, per)  # scattered pages
    cu = torch.arange(rows + 1, **as_long) * tokens
    block = paged_prefix.query_block(Hq // Hkv)
    prefixes, no_write = torch.full((rows,), prefix, **as_long), torch.full((rows,), -1, **as_long)

    chunks_by_block = {m: prepare_chunk_indices(cu, m) for m in (block, *SPLIT_BLOCK_M, *(m for m, _ in TILES))}

    def attn(split, config, spans=paged_prefix.PREFIX_SPANS, block_m=block):
        return paged_prefix.paged_prefix_attention(q=q, k=k, v=v, cu_seqlens=cu, prefix_lens=prefixes,
                                                   key_pages=key_pages, value_pages=value_pages, block_table=table,
                                                   write_slots=no_write, chunk_indices=chunks_by_block[block_m],
                                                   split=split, config=config, spans=spans, block_m=block_m)

    out = {"rows": rows, "tokens": tokens, "prefix": prefix}
    configs = [c for c in paged_prefix.ATTN_CONFIGS if paged_prefix.valid_configs([c], {}, BD=max(32, D))]
    ref = attn(False, configs[0]).float()
    for name, split in (("one_program", False), ("split", True)):
        us = {str(c): graph_us(lambda c=c: attn(split, c)) for c in configs}
        best = min(us, key=us.get)
        got = attn(split, configs[0]).float()
        out[name] = {"best_us": us[best], "best_config": best, "configs_us": us,
                     "rel_err_vs_one_program": ((got - ref).norm() / ref.norm()).item()}
    out["one_program_over_split"] = out["one_program"]["best_us"] / out["split"]["best_us"]
    # Split mode at other span counts (serving fixes PREFIX_SPANS: the merge order depends on it):
    # more spans, more programs over a long prefix, and a larger fp32 workspace to merge. Timed at
    # PREFIX_SPANS' best config only: each count compiles both kernels again.
    best_split = next(c for c in configs if str(c) == out["split"]["best_config"])
    out["split_spans"] = {}
    for spans in SPAN_COUNTS:
        got = attn(True, best_split, spans).float()
        out["split_spans"][spans] = {"us": graph_us(lambda: attn(True, best_split, spans)),
                                     "config": str(best_split),
                                     "rel_err_vs_one_program": ((got - ref).norm() / ref.norm()).item()}
    # Split mode with fewer query tokens a program (serving: query_block), its 4-warp configs (each
    # compiles both kernels again): a [64, 256]
    # fp32 accumulator spills at one value slice; 8 tokens x 4 heads make it [32, 256].
    out["one_program_tiles"] = other_tiles(
        lambda c, m, n: paged_prefix.paged_prefix_attention(
            q=q, k=k, v=v, cu_seqlens=cu, prefix_lens=prefixes, key_pages=key_pages, value_pages=value_pages,
            block_table=table, write_slots=no_write, chunk_indices=chunks_by_block[m], split=False, config=c, block_m=m,
            block_n=n), configs, ref)
    out["split_block_m"] = {}
    for m in SPLIT_BLOCK_M:
        us = {str(c): graph_us(lambda c=c: attn(True, c, block_m=m)) for c in configs if c.num_warps == 4}
        best = min(us, key=us.get)
        got = attn(True, configs[0], block_m=m).float()
        out["split_block_m"][m] = {"best_us": us[best], "best_config": best, "configs_us": us,
                                   "rel_err_vs_one_program": ((got - ref).norm() / ref.norm()).item()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention_ab.json")
    args = ap.parse_args()
    cfg = kev4b_config()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    result = {**run_info(), "calls_per_graph": CALLS, "cases": []}
    for docs, tokens in SHAPES:
        entry = case(cfg, docs, tokens, gen)
        result["cases"].append(entry)
        write_json(args.out, result)  # partial results survive a time-out
        print(f"{docs}x{tokens}: paged {entry['paged_us']:.1f} us ({entry.get('paged_tflops', 0):.0f} TFLOP/s), "
              f"sdpa flash {entry.get('sdpa_flash_us', float('nan')):.1f} us "
              f"({entry.get('sdpa_flash_tflops', 0):.0f} TFLOP/s) {entry.get('sdpa_error', '')}; tiles "
              + ", ".join(f"{t}: {e['best_us']}" for t, e in entry["tiles"].items()), flush=True)
        torch.cuda.empty_cache()
    result["rows"] = []
    for rows, tokens, prefix in ROW_SHAPES:
        entry = row_case(cfg, rows, tokens, prefix, gen)
        result["rows"].append(entry)
        write_json(args.out, result)
        print(f"{rows}x{tokens}@{prefix}: one program {entry['one_program']['best_us']:.1f} us, split "
              f"{entry['split']['best_us']:.1f} us ({entry['split']['best_config']}), rel err "
              f"{entry['split']['rel_err_vs_one_program']:.1e}; split by spans "
              + ", ".join(f"{n}: {e['us']:.1f}" for n, e in entry["split_spans"].items())
              + "; split by query tokens a program "
              + ", ".join(f"{m}: {e['best_us']:.1f}" for m, e in entry["split_block_m"].items()), flush=True)
        torch.cuda.empty_cache()
    write_json(args.out, result)


if __name__ == "__main__":
    main()
