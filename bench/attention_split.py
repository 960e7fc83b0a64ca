"""Paged attention's two modes side by side: the one-program loop and split mode (a program per
prefix span, then the combine kernel), every config of each, on the rows_few shapes it serves and
a few wider ones. Kev-4B heads, bf16, one attention layer's pages; the kernels alone (CUDA events,
`triton.testing.do_bench` median). Each shape also checks that the two modes give the same bits.

    python -m bench.attention_split --out bench/results/attention_split.json
"""

from __future__ import annotations

import argparse

import torch
import triton

from bench.autotune_map import DEVICE, Layer
from bench.common import kev4b_config, run_info, write_json
from kev.ops.attention import paged_prefix
from kev.ops.autotune import ClassShape, classify

SHAPES = [ClassShape(1, 16), ClassShape(6, 32, 48), ClassShape(5, 32, 2200), ClassShape(6, 32, 2200),
          ClassShape(8, 64, 2200), ClassShape(8, 128, 2200), ClassShape(16, 64, 2200)]


def run(layer, cfg, shape: ClassShape, gen) -> dict:
    n, L, prefix = shape.seqs, shape.tokens, shape.prefix
    T, Hq, Hkv, D = n * L, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    as_long = dict(dtype=torch.int64, device=DEVICE)
    slots = torch.arange(n, **as_long) % layer.table.shape[0]
    dev = dict(device=DEVICE, generator=gen)
    q = torch.randn(T, Hq, D, **dev).bfloat16()
    k, v = (torch.randn(T, Hkv, D, **dev).bfloat16() for _ in range(2))
    cu = torch.arange(n + 1, **as_long) * L
    chunks = triton.cdiv(L, paged_prefix.query_block(Hq // Hkv))
    chunk_indices = torch.stack([torch.arange(n, **as_long).repeat_interleave(chunks),
                                 torch.arange(chunks, **as_long).repeat(n)], 1)

    def call(split, config):
        return paged_prefix.paged_prefix_attention(
            q=q, k=k, v=v, cu_seqlens=cu, prefix_lens=torch.full((n,), prefix, **as_long), key_pages=layer.keys,
            value_pages=layer.values, block_table=layer.table[slots], write_slots=torch.full((n,), -1, **as_long),
            chunk_indices=chunk_indices, split=split, config=config)

    out = {"shape": str(shape), "class": classify(n, T).value, "tokens": T}
    reference = call(False, paged_prefix.ATTN_CONFIGS[0])
    for split in (False, True):
        configs = [*paged_prefix.ATTN_CONFIGS, *([paged_prefix.SPLIT_CONFIG] if split else [])]
        times, identical = {}, True
        for c in configs:
            identical &= torch.equal(call(split, c), reference)
            times[str(c)] = triton.testing.do_bench(lambda c=c: call(split, c), warmup=5, rep=30,
                                                    return_mode="median") * 1e3
        best = min(times, key=times.get)
        out["split" if split else "one_program"] = {"best_us": times[best], "best_config": best,
                                                    "identical_to_one_program": identical, "configs_us": times}
    out["split"]["split_config_us"] = out["split"]["configs_us"][str(paged_prefix.SPLIT_CONFIG)]
    out["one_program_best_over_split_config"] = out["one_program"]["best_us"] / out["split"]["split_config_us"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/attention_split.json")
    args = ap.parse_args()
    cfg = kev4b_config()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layer = Layer(cfg, gen)
    result = {**run_info(), "prefix_spans": paged_prefix.PREFIX_SPANS, "split_config": str(paged_prefix.SPLIT_CONFIG),
              "shapes": []}
    for shape in SHAPES:
        entry = run(layer, cfg, shape, gen)
        result["shapes"].append(entry)
        print(f"{entry['shape']:>14} {entry['class']:>9}: one program {entry['one_program']['best_us']:7.1f} us, "
              f"split {entry['split']['split_config_us']:7.1f} us (best {entry['split']['best_us']:7.1f}: "
              f"{entry['split']['best_config']}); identical "
              f"{entry['split']['identical_to_one_program'] and entry['one_program']['identical_to_one_program']}",
              flush=True)
    result["all_identical"] = all(e[m]["identical_to_one_program"] for e in result["shapes"]
                                  for m in ("one_program", "split"))
    write_json(args.out, result)


if __name__ == "__main__":
    main()
