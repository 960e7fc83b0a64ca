"""Config map: every config of each hot kernel on the served shape classes (issue 5, point 4).

Kev-4B layer shapes, bf16 (one DeltaNet layer's conv + chunked delta rule, one attention layer),
on one layer's pools. For each served shape the three ops run once with every hot autotuner's
launch recorded (first config, no tuning), then every config of each recorded launch is timed
with `triton.testing.do_bench` (median). Per kernel and served shape:
- best_us: the fastest config;
- chosen_us: the config the shape's class cache holds after `ClassTuner` autotuned the class on
  its representative shape (the real autotuner, as `warm_up` does at start-up);
- first_call_pick_us: the config a 1-sequence x 16-token first call picks (fastest there).

    python -m bench.autotune_map --out bench/results/autotune_classes.json
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch
import triton

from bench.common import kev4b_config, run_info, write_json
from kev.ops.autotune import REPRESENTATIVE, ClassTuner, ShapeClass, classify, hot_autotuners
from kev.ops.meta import PassMeta
from kev.ops.triton_ops import TritonOps

DEVICE = "cuda"
BS = 64  # K/V page size
ROW_PREFIX = 2200
# (label, sequences, tokens each, stored prefix): rows over cached documents, long single
# documents (2k-61k: chunks of 8k, the last one over a 57k prefix), batched new documents
SERVED = [
    ("rows 6x32@48", 6, 32, 48), ("rows 5x32@2200", 5, 32, 2200), ("rows 16x64@2200", 16, 64, 2200),
    ("rows 32x64@2200", 32, 64, 2200), ("rows 96x32@2200", 96, 32, 2200), ("rows 96x64@2200", 96, 64, 2200),
    ("doc 1x2200", 1, 2200, 0), ("doc 1x8192", 1, 8192, 0), ("doc 1x4096@57344", 1, 4096, 57344),
    ("docs 16x2048", 16, 2048, 0),
]
FIRST_CALL = ("first call 1x16", 1, 16, 0)


class Layer:
    """One layer's pools (16 row slots of up to 2,304 tokens, one slot for a 61k document) and weights."""

    def __init__(self, cfg, gen):
        self.cfg = cfg
        HV, K, V, C = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_dim
        per, long = -(-2304 // BS), -(-61440 // BS)
        S = 17
        self.table = torch.full((S, long), 0, dtype=torch.int32)
        for s in range(16):
            self.table[s, :per] = torch.arange(s * per, (s + 1) * per, dtype=torch.int32)
        self.table[16] = torch.arange(16 * per, 16 * per + long, dtype=torch.int32)
        self.table = self.table.to(DEVICE)
        blocks = 16 * per + long
        kv = (blocks, BS, cfg.num_key_value_heads, cfg.head_dim)
        dev = dict(device=DEVICE, generator=gen)
        self.keys = (torch.randn(kv, **dev) * 0.5).bfloat16()
        self.values = torch.randn(kv, **dev).bfloat16()
        self.conv = torch.randn(S, C, cfg.conv_kernel - 1, **dev).bfloat16()
        self.state = torch.randn(S, HV, K, V, **dev) * 0.05
        self.weight = (torch.randn(C, cfg.conv_kernel, **dev) * 0.3).bfloat16()

    def run(self, ops, n, L, prefix, gen):
        """The three ops on n sequences of L tokens (rows read slots n % 16; a long prefix reads slot 16)."""
        cfg, T = self.cfg, n * L
        H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        as_long = dict(dtype=torch.int64, device=DEVICE)
        slots = torch.arange(n, **as_long) % 16 if prefix <= 2304 else torch.full((n,), 16, **as_long)
        read = slots if prefix > 0 else torch.full((n,), -1, **as_long)
        meta = PassMeta(cu_seqlens=torch.arange(n + 1, **as_long) * L, read_slots=read,
                        write_slots=torch.full((n,), -1, **as_long), prefix_lens=torch.full((n,), prefix, **as_long),
                        block_table=self.table[slots])
        dev = dict(device=DEVICE, generator=gen)
        x = torch.randn(T, cfg.conv_dim, **dev).bfloat16()
        y = ops.causal_conv(x, self.weight, meta, self.conv)
        hk = H * K
        q, k = y[:, :hk].unflatten(1, (H, K)), y[:, hk:2 * hk].unflatten(1, (H, K))
        v = y[:, 2 * hk:].unflatten(1, (HV, V))
        g = -torch.rand(T, HV, **dev) * 0.5
        beta = torch.rand(T, HV, **dev).bfloat16()
        ops.gated_delta_rule(q, k, v, g, beta, meta, self.state)
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        aq = torch.randn(T, Hq, D, **dev).bfloat16()
        ak, av = (torch.randn(T, Hkv, D, **dev).bfloat16() for _ in range(2))
        ops.attention(aq, ak, av, meta, self.keys, self.values)


@contextmanager
def recording(hot):
    """Each hot autotuner records its first launch and runs its first config (no tuning)."""
    launches = {}

    def recorder(name, at):
        def run(*args, **kwargs):
            launches.setdefault(name, (args, kwargs))
            return at.fn.run(*args, **kwargs, **at.configs[0].all_kwargs())
        return run

    for name, at in hot.items():
        at.run = recorder(name, at)
    try:
        yield launches
    finally:
        for at in hot.values():
            del at.run


def time_configs(at, args, kwargs) -> dict[str, float]:
    """Median microseconds of every config of one recorded launch (inf where it does not compile)."""
    out = {}
    for cfg in at.configs:
        def call(cfg=cfg):
            at.fn.run(*args, **kwargs, **cfg.all_kwargs())
        try:
            call()
            out[str(cfg)] = triton.testing.do_bench(call, warmup=5, rep=20, return_mode="median") * 1e3  # ms -> us
        except Exception as e:  # noqa: BLE001 - an out-of-resources config is simply not a choice
            print(f"  {at.base_fn.__name__} {cfg}: {type(e).__name__}")
            out[str(cfg)] = float("inf")
    return out


def shape_table(layer, ops, hot, shape, gen) -> dict[str, dict[str, float]]:
    _, n, L, prefix = shape
    with recording(hot) as launches:
        layer.run(ops, n, L, prefix, gen)
    table = {name: time_configs(hot[name], *launches[name]) for name in hot}
    del launches
    torch.cuda.synchronize()
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/autotune_classes.json")
    args = ap.parse_args()
    cfg = kev4b_config()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layer, ops = Layer(cfg, gen), TritonOps()
    hot = hot_autotuners()
    tuner = ClassTuner(hot)
    t0 = time.perf_counter()
    first = shape_table(layer, ops, hot, FIRST_CALL, gen)
    first_pick = {name: min(t, key=t.get) for name, t in first.items()}
    # the class caches, tuned by the real autotuner on each class's representative shape
    for cls, (n, L) in REPRESENTATIVE.items():
        with tuner.use(cls):
            layer.run(ops, n, L, ROW_PREFIX if cls.rows else 0, gen)
    chosen = {cls: {name: str(next(iter(cache.values()), hot[name].configs[0]))  # one config: never cached
                    for name, cache in tuner.caches(cls).items()} for cls in ShapeClass}
    result = {**run_info(), "classes": [], "first_call_configs": first_pick, "tune_s": time.perf_counter() - t0,
              "representative": {c.value: list(v) for c, v in REPRESENTATIVE.items()}}
    for shape in SERVED:
        label, n, L, prefix = shape
        cls = classify(n, n * L)
        table = shape_table(layer, ops, hot, shape, gen)
        for name, t in table.items():
            best = min(t, key=t.get)
            pick = chosen[cls][name]
            result["classes"].append({
                "kernel": name, "shape_class": f"{cls.value}: {label}", "class": cls.value, "shape": label,
                "best_us": t[best], "chosen_us": t[pick], "first_call_pick_us": t[first_pick[name]],
                "best_config": best, "chosen_config": pick, "first_call_config": first_pick[name],
                "chosen_over_best": t[pick] / t[best], "first_call_over_best": t[first_pick[name]] / t[best],
                "configs_us": {c: (v if v != float("inf") else None) for c, v in t.items()}})
        print(f"{label}: " + ", ".join(f"{e['kernel']} {e['chosen_over_best']:.2f}/{e['first_call_over_best']:.2f}"
                                       for e in result["classes"][-len(table):]), flush=True)
        with open(args.out, "w") as f:  # partial results survive a time-out
            json.dump(result, f, indent=1)
        torch.cuda.empty_cache()
    worst = max(e["chosen_over_best"] for e in result["classes"])
    result["worst_chosen_over_best"] = worst
    write_json(args.out, result)


if __name__ == "__main__":
    main()
