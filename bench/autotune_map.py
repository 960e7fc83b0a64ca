"""Config map: every config of each hot kernel on every shape class (issue 5, point 4).

Kev-4B layer shapes, bf16 (one DeltaNet layer's conv + chunked delta rule, one attention layer),
on one layer's pools. The shapes are the classes' own (`kev.ops.autotune.CLASS_SHAPES`, what
`warm_up` tunes each class on):
1. every class is tuned as `warm_up` does it (`ClassTuner.tune`: Triton's autotuner on each of the
   class's shapes, per key the config with the least total time pinned in the class cache);
2. each shape runs once in its class (no tuning: the map fails if a key was not pinned), each hot
   autotuner's first launch recorded with the config the class cache gave it;
3. every config of each recorded launch is timed by CUDA-graph replay (`kev.ops.autotune.graph_bench`,
   the serving tuner's benchmarker: what the class tune measured, measured again), in ROUNDS
   interleaved rounds (the median of the rounds).
One entry per (kernel, shape class), totals over the class's shapes:
- best_us: the config with the least total;
- chosen_us: what the class cache launched, summed over the shapes;
- first_call_pick_us: the total of the config a 1-sequence x 16-token first call picks (fastest there);
- shapes: the per-shape view (each shape's best, chosen and first-call config and every config's time).

    python -m bench.autotune_map --out bench/results/autotune_classes.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from contextlib import contextmanager

import torch

from bench.common import kev4b_config, run_info, write_json
from kev.ops.shapes import CLASS_SHAPES, ClassShape, ShapeClass
from kev.ops.autotune import ClassTuner, graph_bench, hot_autotuners
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.triton_ops import TritonOps

DEVICE = "cuda"
BS = 64  # K/V page size
SLOTS, SLOT_TOKENS = 16, 2304  # row slots: the class shapes' prefixes are at most 2,200 tokens
FIRST_CALL = ClassShape(1, 16)


class Layer:
    """One layer's pools (16 slots of up to 2,304 tokens) and weights."""

    def __init__(self, cfg, gen):
        self.cfg = cfg
        HV, K, V, C = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.conv_dim
        per = -(-SLOT_TOKENS // BS)
        self.table = (torch.arange(SLOTS * per, dtype=torch.int32).view(SLOTS, per)).to(DEVICE)
        kv = (SLOTS * per, BS, cfg.num_key_value_heads, cfg.head_dim)
        dev = dict(device=DEVICE, generator=gen)
        self.keys = (torch.randn(kv, **dev) * 0.5).bfloat16()
        self.values = torch.randn(kv, **dev).bfloat16()
        self.conv = torch.randn(SLOTS, C, cfg.conv_kernel - 1, **dev).bfloat16()
        self.state = torch.randn(SLOTS, HV, K, V, **dev) * 0.05
        self.weight = (torch.randn(C, cfg.conv_kernel, **dev) * 0.3).bfloat16()

    def run(self, ops, shape: ClassShape, gen):
        """The three ops on `shape` (sequence i reads slot i % 16 when it has a prefix)."""
        cfg, n, L, prefix = self.cfg, shape.seqs, shape.tokens, shape.prefix
        if prefix > SLOT_TOKENS:
            raise ValueError(f"{shape}: prefixes up to {SLOT_TOKENS} tokens fit the layer's slots")
        T = n * L
        H, HV, K, V = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        as_long = dict(dtype=torch.int64, device=DEVICE)
        slots = torch.arange(n, **as_long) % SLOTS
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
        ab = torch.randn(T, 2 * HV, **dev).bfloat16()  # the a and b projections, as the model's columns
        gates = DeltaGates(ab[:, :HV], ab[:, HV:], torch.randn(HV, **dev), torch.randn(HV, **dev))
        ops.gated_delta_rule(q, k, v, gates, meta, self.state)
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        aq = torch.randn(T, Hq, D, **dev).bfloat16()
        ak, av = (torch.randn(T, Hkv, D, **dev).bfloat16() for _ in range(2))
        ops.attention(aq, ak, av, meta, self.keys, self.values)


@contextmanager
def recording(hot, tuned: bool):
    """Each hot autotuner records its first launch: (args, kwargs, config). `tuned`: launches run
    as the autotuner runs them (the active class cache's config); else on the first config, untuned."""
    launches = {}

    def recorder(name, at):
        def run(*args, **kwargs):
            if tuned:
                out = type(at).run(at, *args, **kwargs)
                config = at.best_config
            else:
                config = at.configs[0]
                out = at.fn.run(*args, **kwargs, **config.all_kwargs())
            launches.setdefault(name, (args, kwargs, config))
            return out
        return run

    for name, at in hot.items():
        at.run = recorder(name, at)
    try:
        yield launches
    finally:
        for at in hot.values():
            del at.run


ROUNDS = 3  # timing rounds over all configs of a launch, interleaved


def time_configs(at, args, kwargs) -> dict[str, float]:
    """Microseconds of every config of one recorded launch (inf where it does not compile): the
    median over ROUNDS rounds, each timing every config once (`graph_bench`, median of its replays).
    Interleaved, a drift of the GPU's clock over the configs' timings lands on all of them, not on
    the configs timed last; the 5-6 us kernels' misses moved between runs like such noise."""
    calls, out = {}, {}
    for cfg in at.configs:
        def call(cfg=cfg):
            at.fn.run(*args, **kwargs, **cfg.all_kwargs())
        try:
            call()
            calls[str(cfg)] = call
        except Exception as e:  # noqa: BLE001 - an out-of-resources config is simply not a choice
            print(f"  {at.base_fn.__name__} {cfg}: {type(e).__name__}")
            out[str(cfg)] = float("inf")
    rounds = {name: [] for name in calls}
    for _ in range(ROUNDS):
        for name, call in calls.items():
            rounds[name].append(graph_bench(call))
    out.update({name: statistics.median(ts) * 1e3 for name, ts in rounds.items()})  # ms -> us
    return {str(cfg): out[str(cfg)] for cfg in at.configs}


def shape_table(layer, ops, hot, shape, gen, tuner=None, cls=None):
    """Name -> {config: us} on `shape`, and name -> the config launched: the class cache's when
    `cls` is given (which must not tune), else the first config."""
    if cls is None:
        with recording(hot, tuned=False) as launches:
            layer.run(ops, shape, gen)
    else:
        sizes = [len(c) for c in tuner.caches(cls).values()]
        with recording(hot, tuned=True) as launches, tuner.use(cls):
            layer.run(ops, shape, gen)
        if [len(c) for c in tuner.caches(cls).values()] != sizes:
            raise RuntimeError(f"{cls.value} {shape}: a kernel autotuned after its class was tuned")
    table = {name: time_configs(hot[name], args, kwargs) for name, (args, kwargs, _) in launches.items()}
    used = {name: str(config) for name, (_, _, config) in launches.items()}
    del launches
    torch.cuda.synchronize()
    return table, used


def _us(v: float) -> float | None:
    return v if math.isfinite(v) else None


def class_entry(kernel: str, cls: ShapeClass, shapes: dict[str, tuple[dict[str, float], str]],
                first: str | None) -> dict:
    """One (kernel, class) entry from the class's shapes that launched the kernel: label ->
    ({config: us}, the config the class cache launched). `first`: the first call's pick (None
    when the first call did not launch the kernel)."""
    totals = {c: math.fsum(t[c] for t, _ in shapes.values()) for c in next(iter(shapes.values()))[0]}
    best = min(totals, key=totals.get)
    chosen_us = math.fsum(t[c] for t, c in shapes.values())
    first_us = totals[first] if first is not None else math.nan
    detail = []
    for label, (t, chosen) in shapes.items():
        b = min(t, key=t.get)
        f = t[first] if first is not None else math.nan
        detail.append({"shape": label, "best_us": t[b], "chosen_us": t[chosen], "first_call_pick_us": _us(f),
                       "chosen_over_best": t[chosen] / t[b], "first_call_over_best": _us(f / t[b]),
                       "best_config": b, "chosen_config": chosen,
                       "configs_us": {c: _us(v) for c, v in t.items()}})
    return {"kernel": kernel, "shape_class": cls.value, "best_us": totals[best], "chosen_us": chosen_us,
            "first_call_pick_us": _us(first_us), "chosen_over_best": chosen_us / totals[best],
            "first_call_over_best": _us(first_us / totals[best]), "best_config": best,
            "chosen_configs": sorted({c for _, c in shapes.values()}), "first_call_config": first,
            "shapes": detail}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/autotune_classes.json")
    args = ap.parse_args()
    cfg = kev4b_config()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    layer, ops = Layer(cfg, gen), TritonOps()
    hot = hot_autotuners()
    tuner = ClassTuner(hot, bench=graph_bench)  # serving_tuner(), on the autotuners recorded here
    first, _ = shape_table(layer, ops, hot, FIRST_CALL, gen)
    first_pick = {name: min(t, key=t.get) for name, t in first.items()}
    t0 = time.perf_counter()
    for cls, shapes in CLASS_SHAPES.items():  # as warm_up does it, on this layer's ops
        tuner.tune(cls, [functools.partial(layer.run, ops, s, gen) for s in shapes])
    torch.cuda.synchronize()
    result = {**run_info(), "classes": [], "first_call_configs": first_pick, "tune_s": time.perf_counter() - t0,
              "class_shapes": {c.value: [str(s) for s in shapes] for c, shapes in CLASS_SHAPES.items()}}
    for cls, shapes in CLASS_SHAPES.items():
        tables = {}
        for s in shapes:
            tables[str(s)] = shape_table(layer, ops, hot, s, gen, tuner, cls)
            torch.cuda.empty_cache()
        launched = {name: {label: (t[name], used[name]) for label, (t, used) in tables.items() if name in t}
                    for name in hot}  # a kernel a class's passes never launch has no entry
        entries = [class_entry(name, cls, shapes_of, first_pick.get(name)) for name, shapes_of in launched.items()
                   if shapes_of]
        result["classes"] += entries
        print(f"{cls.value} {[str(s) for s in shapes]} chosen/first-call over best: "
              + ", ".join(f"{e['kernel']} {e['chosen_over_best']:.3f}/{e['first_call_over_best'] or math.nan:.2f}"
                          for e in entries), flush=True)
        with open(args.out, "w") as f:  # partial results survive a time-out
            json.dump(result, f, indent=1)
    result["worst_chosen_over_best"] = max(e["chosen_over_best"] for e in result["classes"])
    result["worst_shape_chosen_over_best"] = max(d["chosen_over_best"] for e in result["classes"] for d in e["shapes"])
    write_json(args.out, result)


if __name__ == "__main__":
    main()
