"""Autotune by shape class: one autotune cache per shape class for every hot Triton kernel.

Triton's `Autotuner` keeps one `.cache` dict per kernel, keyed by the kernel's `key` arguments.
fla's keys omit the sequence count and length, so whatever call comes first (often a tiny
warm-up) decides the config of every later pass; measured on the H200, that costs wide passes
1.1-1.9x (docs/design.md §3). Here a pass is put into a `ShapeClass` from host ints known when it is
built (sequence count and token count: rows vs documents, few vs many), and `ClassTuner.use(cls)`
swaps every hot autotuner's `.cache` for that class's own dict around the pass. The project's own
kernels also carry log2 (count, length) buckets in their keys (`N_CLASS`, `T_CLASS`); inside a
class those entries are dropped from the key, so the class alone decides and a pass of an
unwarmed bucket never autotunes (an autotune inside CUDA-graph capture breaks the capture).

Per worker process: the autotuners are module globals, so every process (scorer worker, bank
service) tunes its own. Triton's on-disk autotune cache is turned off for these kernels (fla
enables it by default through FLA_CACHE_RESULTS): a config tuned by another process, on another
shape, would be reused silently.

A class serves many shapes, and one shape's best config can be 1.1-1.5x on another of the same
class (the H200 map). So a class is tuned on several shapes (`CLASS_SHAPES`): `ClassTuner.tune`
runs each shape's pass with fresh caches, so Triton's own autotuner benchmarks every config of
every key the pass hits, keeps those timings, and pins in the class cache, per key, the config
with the least total time over the class's shapes. `kev.exec.warm_up.warm_up` does that with the
real model, dtypes and pools before any CUDA-graph capture; nothing tunes again for a key pinned there.
A serving tuner (`serving_tuner`) times each config by CUDA-graph replay (`graph_bench`), as
passes are served, not by Triton's `do_bench`.

    tuner = serving_tuner()                  # ClassTuner(hot_autotuners(), bench=graph_bench)
    runner = Passes(model, bank, TritonOps(), tuner=tuner)
    warm_up(runner, ShapeClass)              # start-up: tune every class over its shapes
    with tuner.use(classify(n_tokens, rows=True)):
        model(...)                           # what Passes does around each pass
"""

from __future__ import annotations

import math
import statistics
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from triton.runtime.autotuner import Autotuner, Config

from kev.ops.shapes import CLASS_SHAPES, ClassShape, ShapeClass, classify  # noqa: F401 - the tuner's vocabulary

CLASS_KEY_ARGS = frozenset({"N_CLASS", "T_CLASS"})  # the own kernels' finer buckets, dropped inside a class


def unwrap_autotuner(kernel) -> Autotuner:
    """The `Autotuner` inside a kernel object (`triton.heuristics` wraps fla's)."""
    obj = kernel
    while not isinstance(obj, Autotuner):
        if not hasattr(obj, "fn"):
            raise TypeError(f"{kernel!r} is not an autotuned Triton kernel")
        obj = obj.fn
    return obj


def hot_autotuners() -> dict[str, Autotuner]:
    """Every autotuned kernel a `TritonOps` pass launches: the project's own and fla's."""
    from fla.ops.common.chunk_o import chunk_fwd_kernel_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_kkt_solve_kernel
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd_kernel

    from kev.ops.attention import paged_prefix
    from kev.ops.conv import indexed_conv
    from kev.ops.delta_rule import indexed_scan

    kernels = {
        "indexed_conv": indexed_conv._tuned_conv_kernel,
        "kkt_solve": chunk_gated_delta_rule_fwd_kkt_solve_kernel,
        "recompute_w_u": recompute_w_u_fwd_kernel,
        "indexed_scan": indexed_scan._tuned_scan_kernel,
        "chunk_fwd_o": chunk_fwd_kernel_o,
        "paged_prefix_attention": paged_prefix._tuned_attn_kernel,
        "paged_prefix_span": paged_prefix._tuned_span_kernel,  # split mode (rows_few passes)
        "paged_prefix_finish": paged_prefix._tuned_finish_kernel,
    }
    return {name: unwrap_autotuner(k) for name, k in kernels.items()}


class ClassCache(dict):
    """One class's autotune cache for one kernel. Keys lose their `CLASS_KEY_ARGS` entries, so the
    class, not the kernel's own (count, length) bucket, decides the config. Triton and fla only
    use `in`, `[]`, `[]=` and `pop` on an autotuner's cache."""

    def __init__(self, drop: tuple[int, ...] = ()):
        super().__init__()
        self.drop = frozenset(drop)

    def _key(self, key):
        return tuple(v for i, v in enumerate(key) if i not in self.drop) if self.drop else key

    def __contains__(self, key):
        return super().__contains__(self._key(key))

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __setitem__(self, key, value):
        super().__setitem__(self._key(key), value)

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)


class TimingCache(ClassCache):
    """A fresh cache for one measured pass of `ClassTuner.tune`: it keeps, per (class) key, every
    config's time as Triton's autotuner measured it. `Autotuner.run` benchmarks an unseen key,
    stores the fastest config (`cache[key] = ...`) and then keeps all timings in
    `configs_timings`, until its next benchmark; so a key's timings are taken at the next store or
    at the end of the pass (`flush`), and only when the stored config is their fastest (a store
    that no benchmark made, e.g. from fla's config files, is not timed)."""

    def __init__(self, autotuner: Autotuner, drop: tuple[int, ...] = ()):
        super().__init__(drop)
        self.autotuner = autotuner
        self.timings: dict[tuple, dict[Config, float]] = {}  # class key -> config -> time (benchmarker's unit)
        self.full_keys: dict[tuple, tuple] = {}  # class key -> the full key that first hit it
        self._stored: tuple[tuple, Config] | None = None

    def __setitem__(self, key, value):
        self.flush()
        super().__setitem__(key, value)
        self._stored = (self._key(key), value)
        self.full_keys.setdefault(self._key(key), key)

    def flush(self) -> None:
        if self._stored is None:
            return
        (k, value), self._stored = self._stored, None
        raw = getattr(self.autotuner, "configs_timings", None) or {}
        if raw and min(raw, key=raw.get) is value:  # how Autotuner.run picked it
            self.timings[k] = {c: t[0] if isinstance(t, (list, tuple)) else t for c, t in raw.items()}


def pick_config(per_shape: list[Mapping[Config, float]], configs: Iterable[Config] = ()) -> Config:
    """The config with the least total time over a class's shapes (`per_shape`: one shape's
    timings each). The sum of times, not of ratios to each shape's best: it is the class's GPU time
    when its shapes run equally often and what the config map reports (chosen total vs the best
    total), and ratios would let a 5 us shape outvote a 140 us one over a few hundred ns. A config
    that failed (inf) or was not timed on some shape ranks after every one that ran on all of them.
    Ties go to the earlier config in `configs` (the kernel's list), then in the timings: the pick
    is a function of the timings alone. Configs are matched by `str` across shapes."""
    named: dict[str, Config] = {}
    for c in [*configs, *(c for t in per_shape for c in t)]:
        named.setdefault(str(c), c)
    times = [{str(c): v for c, v in t.items()} for t in per_shape]
    timed = [name for name in named if any(name in t for t in times)]
    if not timed:
        raise ValueError("no config was timed on any shape")

    def rank(i_name):
        i, name = i_name
        ts = [t.get(name, math.inf) for t in times]
        finite = [v for v in ts if math.isfinite(v)]
        return len(ts) - len(finite), math.fsum(finite), i

    return named[min(enumerate(timed), key=rank)[1]]


Bench = Callable[[Callable[[], None], Sequence[float] | None], float | list[float]]  # Triton's benchmarker contract

GRAPH_BENCH_MS = 1.0  # GPU time one replay of `graph_bench`'s graph aims at
GRAPH_BENCH_CALLS = 256  # calls in that graph at most
GRAPH_BENCH_REPLAYS = 5


def graph_bench(kernel_call: Callable[[], None], quantiles=None):
    """Triton's benchmarker, the way passes are served: milliseconds per call of `kernel_call`
    captured back to back in one CUDA graph (enough calls for ~GRAPH_BENCH_MS a replay), median
    over GRAPH_BENCH_REPLAYS replays; with `quantiles`, those quantiles of the replays (Triton's
    `do_bench` contract). Why not `do_bench`: it times each call alone between two events after an
    L2 flush, so a 5-25 us kernel's time carries microseconds of event and launch jitter, the size
    of the gaps between its configs (the H200 map's misses on those kernels moved between runs, and
    config timings jumped 2x within one run). Captured with `capture_begin`, not `torch.cuda.graph`,
    which collects garbage and empties the allocator's cache on every entry. A call that fails
    before capture (a config that does not compile or fit) raises as under `do_bench`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        kernel_call()  # compiled, caches warm
        start.record()
        for _ in range(3):
            kernel_call()
        end.record()
        end.synchronize()
        calls = max(1, min(GRAPH_BENCH_CALLS, round(GRAPH_BENCH_MS / max(start.elapsed_time(end) / 3, 1e-3))))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for _ in range(calls):
                kernel_call()
        finally:
            graph.capture_end()
        graph.replay()
        times = []
        for _ in range(GRAPH_BENCH_REPLAYS):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / calls)
    torch.cuda.current_stream().wait_stream(stream)
    del graph
    if quantiles:
        return torch.quantile(torch.tensor(times), torch.tensor(list(quantiles))).tolist()
    return statistics.median(times)


def _run_once(kernel_call, quantiles):
    """A benchmarker that runs each config once and times nothing (all tie): compiles only."""
    kernel_call()
    return [0.0] * len(quantiles) if quantiles else 0.0


@contextmanager
def _benchmarked_by(autotuners: Iterable[Autotuner], bench: Bench | None) -> Iterator[None]:
    """Inside, every autotuner benchmarks with `bench` (None: its own)."""
    if bench is None:
        yield
        return
    saved = []
    for at in autotuners:  # `Autotuner.do_bench` is a cached property: the instance's dict overrides it
        saved.append((at, at.__dict__.get("do_bench")))
        at.__dict__["do_bench"] = bench
    try:
        yield
    finally:
        for at, previous in saved:
            if previous is None:
                at.__dict__.pop("do_bench", None)
            else:
                at.__dict__["do_bench"] = previous


# One lock for every tuner: the autotuners are process globals, so two passes that swap caches
# must not interleave (passes of one process run one at a time on its stream anyway).
_SWAP_LOCK = threading.RLock()


class ClassTuner:
    """Per-class autotune caches for `autotuners` (name -> Autotuner), disk cache off. `bench`
    times each config in `tune` (None: each autotuner's own benchmarker; `serving_tuner` gives
    `graph_bench`)."""

    def __init__(self, autotuners: Mapping[str, Autotuner], bench: Bench | None = None):
        from fla.ops.utils.cache import FLA_CACHE_MODE, FlaCacheMode

        if FLA_CACHE_MODE is not FlaCacheMode.DISABLED:
            raise ValueError(f"FLA_CACHE_MODE={FLA_CACHE_MODE.value}: fla would load configs tuned elsewhere "
                             f"into the class caches; unset it")
        self.autotuners = dict(autotuners)
        self.bench = bench
        self._caches: dict[ShapeClass, dict[str, ClassCache]] = {}
        self._tuned: set[ShapeClass] = set()  # classes `tune` pinned configs for
        self._active: ShapeClass | None = None
        for at in self.autotuners.values():
            at.cache_results = False  # Triton's on-disk autotune cache, off for these kernels

    @staticmethod
    def _drop(at: Autotuner) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(at.keys) if k in CLASS_KEY_ARGS)

    def caches(self, cls: ShapeClass) -> dict[str, ClassCache]:
        """Name -> that class's cache (created empty on first use)."""
        if cls not in self._caches:
            self._caches[cls] = {name: ClassCache(self._drop(at)) for name, at in self.autotuners.items()}
        return self._caches[cls]

    def tuned(self, cls: ShapeClass) -> bool:
        """Whether `cls` was tuned over its shapes (`tune`: every kernel its passes launch has a
        config; one they never launch needs none) or every kernel has a config in `cls`'s cache."""
        return cls in self._tuned or (cls in self._caches and all(len(c) for c in self._caches[cls].values()))

    @contextmanager
    def _swapped(self, cls: ShapeClass, caches: Mapping[str, dict]) -> Iterator[None]:
        with _SWAP_LOCK:
            saved = {name: at.cache for name, at in self.autotuners.items()}
            previous, self._active = self._active, cls
            try:
                for name, at in self.autotuners.items():
                    at.cache = caches[name]
                yield
            finally:
                for name, at in self.autotuners.items():
                    at.cache = saved[name]
                self._active = previous

    @contextmanager
    def use(self, cls: ShapeClass) -> Iterator[None]:
        """Every autotuner reads and fills `cls`'s cache inside; the previous caches come back after."""
        with _SWAP_LOCK, self._swapped(cls, self.caches(cls)):
            yield

    def tune(self, cls: ShapeClass, passes: Iterable[Callable[[], object]]) -> dict[str, dict[tuple, Config]]:
        """Tune `cls` over several shapes: run each of `passes` (one shape's pass each) with fresh
        caches, so Triton's autotuner benchmarks every config of every key the pass hits; then pin
        in `cls`'s cache, per kernel and class key, `pick_config` over the shapes that hit that key.
        A key already in the cache keeps its config (a warmed class never changes). Returns what
        was pinned now: name -> class key -> config."""
        measured: dict[str, dict[tuple, list[dict[Config, float]]]] = {name: {} for name in self.autotuners}
        full_keys: dict[tuple[str, tuple], tuple] = {}
        for run in passes:
            # First every config of every key the pass hits compiles, untimed; then the timed run.
            # Timed in one run, each config is benchmarked right after its own compile, with the GPU
            # idle for the compile; the H200 map's misses (1.1-1.2x, all on kernels of 6-40 us) were
            # configs that ran right after a compile.
            with self._swapped(cls, {name: ClassCache(self._drop(at)) for name, at in self.autotuners.items()}), \
                    _benchmarked_by(self.autotuners.values(), _run_once):
                run()
            fresh = {name: TimingCache(at, self._drop(at)) for name, at in self.autotuners.items()}
            with self._swapped(cls, fresh), _benchmarked_by(self.autotuners.values(), self.bench):
                run()
            for name, cache in fresh.items():
                cache.flush()
                for key, timings in cache.timings.items():
                    measured[name].setdefault(key, []).append(timings)
                    full_keys.setdefault((name, key), cache.full_keys[key])
        caches, pinned = self.caches(cls), {}
        for name, per_key in measured.items():
            for key, per_shape in per_key.items():
                full = full_keys[(name, key)]
                if full not in caches[name]:
                    caches[name][full] = pick_config(per_shape, self.autotuners[name].configs)
                    pinned.setdefault(name, {})[key] = caches[name][full]
        if any(measured.values()):
            self._tuned.add(cls)
        return pinned

    @property
    def active(self) -> ShapeClass | None:
        return self._active

    def chosen(self, cls: ShapeClass) -> dict[str, list[str]]:
        """Name -> the configs `cls`'s cache holds (for logs and the config map)."""
        return {name: [str(c) for c in cache.values()] for name, cache in self.caches(cls).items()}

    @contextmanager
    def pinned(self, cls: ShapeClass, name: str, config: Config) -> Iterator[None]:
        """Inside, kernel `name` runs `config` for every key `cls` tuned (benchmarks: one config
        timed inside the whole pass); `cls`'s own picks come back after. A key `cls` never tuned
        stays unpinned."""
        with _SWAP_LOCK:
            cache = self.caches(cls)[name]
            saved = dict(dict.items(cache))  # the stored (class) keys, not re-keyed by ClassCache
            try:
                for key in saved:
                    dict.__setitem__(cache, key, config)
                yield
            finally:
                dict.clear(cache)
                dict.update(cache, saved)


def serving_tuner() -> ClassTuner:
    """The tuner of a serving process (and of the benchmarks that measure one): every hot kernel,
    each config timed by CUDA-graph replay (`graph_bench`)."""
    return ClassTuner(hot_autotuners(), bench=graph_bench)
