"""Shape-class autotune caches (kev.ops.autotune), on CPU with stubbed kernels.

A real `triton.autotune`d kernel whose launches are stubbed out (`fn.run` records the config,
`do_bench` returns made-up timings in which small passes prefer BLOCK 16 and wide ones BLOCK 32)
shows: the class comes from cu_seqlens / batch sizes, the on-disk cache is off, each class keeps
its own cache (a tiny first call does not decide a wide pass), inside a class the kernel's own
(N_CLASS, T_CLASS) buckets do not re-tune, and the default caches come back afterwards. Then the
same with fla's real autotuners (found by `hot_autotuners`) and the Passes's use of the tuner.
Last, tuning a class over several shapes (`ClassTuner.tune`, `warm_up`) with timings that differ
by shape: the pick minimises the total over the class's shapes, per class, deterministically, and
nothing tunes again once it is pinned.
"""

import math
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from kev.bank.bank import Bank
from kev.ops import get_ops
from kev.ops.shapes import (CLASS_SHAPES, ClassShape, ShapeClass, classify, classify_cu_seqlens, classify_lens,
                             classify_seqs)
from kev.ops.autotune import ClassTuner, hot_autotuners, pick_config
from kev.exec.warm_up import warm_shapes, warm_up
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from random_models import random_model, tiny_config


@triton.jit
def stub_kernel(x, T, N_CLASS, T_CLASS, H: tl.constexpr, BLOCK: tl.constexpr):
    pass


class FakeLaunch:
    """Stands in for the JIT function: records each launch's config instead of compiling."""

    def __init__(self):
        self.launches = []

    def run(self, *args, **kwargs):
        self.launches.append(kwargs["BLOCK"])


class FakeBench:
    """`do_bench` stand-in: BLOCK 16 is faster below 1,000 tokens, BLOCK 32 above."""

    def __init__(self, launch: FakeLaunch):
        self.launch, self.calls, self.tokens = launch, 0, 0

    def __call__(self, kernel_call, quantiles):
        kernel_call()
        self.calls += 1
        block = self.launch.launches[-1]
        t = 1.0 if (block == 16) == (self.tokens < 1000) else 2.0
        return [t, t, t]


@pytest.fixture
def stub():
    launch = FakeLaunch()
    bench = FakeBench(launch)
    at = triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})],
                         key=["H", "N_CLASS", "T_CLASS"], do_bench=bench, cache_results=True)(stub_kernel)
    at.fn = launch
    return at, launch, bench


def call(at, bench, n_seqs, n_tokens):
    bench.tokens = n_tokens
    # the own kernels' buckets: log2 of the count and of the mean length (kev.ops.conv.indexed_conv.shape_class)
    at.run(torch.zeros(1), n_tokens, max(n_seqs - 1, 0).bit_length(), max(n_tokens // n_seqs - 1, 0).bit_length(), H=2)


# one representative per class boundary side: what changes the cache a pass uses. A pass of unknown
# kind is rows while its sequences average at most ROW_TOKENS (128) tokens; then its token count decides.
@pytest.mark.parametrize("lens,cls", [
    ([16], ShapeClass.ROWS_FEW), ([32] * 8, ShapeClass.ROWS_FEW), ([64] * 4, ShapeClass.ROWS_FEW),
    ([65] * 4, ShapeClass.ROWS_MID), ([48] * 9, ShapeClass.ROWS_MID), ([32] * 32, ShapeClass.ROWS_MID),
    ([33] * 32, ShapeClass.ROWS_WIDE), ([32] * 96, ShapeClass.ROWS_WIDE), ([128] * 10, ShapeClass.ROWS_WIDE),
    ([129] * 10, ShapeClass.DOCS_FEW), ([256], ShapeClass.ROWS_FEW), ([257], ShapeClass.DOCS_FEW),
    ([2200], ShapeClass.DOCS_FEW), ([4096], ShapeClass.DOCS_FEW), ([300] * 5, ShapeClass.DOCS_FEW),
    ([4097], ShapeClass.DOCS_WIDE), ([2048] * 16, ShapeClass.DOCS_WIDE), ([8192] * 4, ShapeClass.DOCS_WIDE),
], ids=lambda v: str(v) if isinstance(v, ShapeClass) else f"{len(v)}x{v[0]}")
def test_class_from_cu_seqlens_and_batch_size(lens, cls):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    assert classify_cu_seqlens(cu) is cls
    assert classify_cu_seqlens(cu.tolist()) is cls
    assert classify_lens(lens) is cls
    assert classify_seqs(len(lens), sum(lens)) is cls


@pytest.mark.parametrize("tokens,rows,states", [
    (1, ShapeClass.ROWS_FEW, ShapeClass.ROWS_FEW), (256, ShapeClass.ROWS_FEW, ShapeClass.ROWS_FEW),
    (257, ShapeClass.ROWS_MID, ShapeClass.DOCS_FEW), (1024, ShapeClass.ROWS_MID, ShapeClass.DOCS_FEW),
    (1025, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_FEW), (4096, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_FEW),
    (4097, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_WIDE), (16384, ShapeClass.ROWS_WIDE, ShapeClass.DOCS_WIDE),
])
def test_class_from_kind_and_tokens(tokens, rows, states):
    """A pass of known kind (a graph key, a row batch, a state pass): its kind and token count alone,
    whatever its sequences; state passes of at most 256 tokens share the rows' few class."""
    assert classify(tokens, rows=True) is rows
    assert classify(tokens, rows=False) is states


def test_classify_rejects_empty_and_device_cu_seqlens():
    with pytest.raises(ValueError, match="at least one token"):
        classify(0, rows=True)
    with pytest.raises(ValueError, match="at least one token"):
        classify_seqs(0, 0)
    meta = torch.tensor([0, 4], device="meta")
    with pytest.raises(ValueError, match="host"):
        classify_cu_seqlens(meta)


def test_disk_cache_off(stub, monkeypatch):
    at, launch, bench = stub
    assert at.cache_results, "the stub starts with Triton's on-disk autotune cache on"
    ClassTuner({"stub": at})
    assert at.cache_results is False

    def no_disk(*args, **kwargs):
        raise AssertionError("the on-disk autotune cache was consulted")

    monkeypatch.setattr(at, "check_disk_cache", no_disk)
    call(at, bench, 1, 16)  # even outside a class: the disk cache stays off for these kernels


def test_classes_keep_their_own_caches(stub):
    at, launch, bench = stub
    tuner = ClassTuner({"stub": at})
    default = at.cache
    with tuner.use(ShapeClass.ROWS_FEW):
        call(at, bench, 1, 16)  # the tiny first call
    assert bench.calls == 2 and launch.launches[-1] == 16
    with tuner.use(ShapeClass.ROWS_WIDE):
        call(at, bench, 96, 96 * 64)  # tuned on its own shape, not the first call's pick
    assert bench.calls == 4 and launch.launches[-1] == 32
    with tuner.use(ShapeClass.ROWS_FEW):
        call(at, bench, 6, 6 * 32)  # other own buckets (N_CLASS, T_CLASS), same class: no re-tune
    assert bench.calls == 4 and launch.launches[-1] == 16
    with tuner.use(ShapeClass.ROWS_WIDE):
        call(at, bench, 48, 48 * 40)
    assert bench.calls == 4 and launch.launches[-1] == 32
    assert at.cache is default and len(default) == 0, "the default cache was touched"
    assert [len(c) for c in tuner.caches(ShapeClass.ROWS_FEW).values()] == [1]
    assert tuner.tuned(ShapeClass.ROWS_WIDE) and not tuner.tuned(ShapeClass.DOCS_FEW)
    assert tuner.chosen(ShapeClass.ROWS_WIDE)["stub"][0].startswith("BLOCK: 32")


def test_caches_restored_on_error_and_nested(stub):
    at, launch, bench = stub
    tuner = ClassTuner({"stub": at})
    default = at.cache
    with pytest.raises(RuntimeError):
        with tuner.use(ShapeClass.DOCS_WIDE):
            raise RuntimeError("pass failed")
    assert at.cache is default and tuner.active is None
    with tuner.use(ShapeClass.ROWS_FEW):
        with tuner.use(ShapeClass.DOCS_FEW):
            assert at.cache is tuner.caches(ShapeClass.DOCS_FEW)["stub"]
        assert at.cache is tuner.caches(ShapeClass.ROWS_FEW)["stub"] and tuner.active is ShapeClass.ROWS_FEW
    assert at.cache is default


@pytest.fixture
def fla_tuner(monkeypatch):
    """A ClassTuner over the real hot autotuners; their globals are put back afterwards."""
    hot = hot_autotuners()
    for at in hot.values():
        monkeypatch.setattr(at, "cache_results", at.cache_results)
        monkeypatch.setattr(at, "cache", at.cache)
    return ClassTuner(hot), hot


def test_hot_autotuners_cover_the_triton_path(fla_tuner):
    tuner, hot = fla_tuner
    assert set(hot) == {"indexed_conv", "kkt_solve", "recompute_w_u",
                        "indexed_scan", "chunk_fwd_o", "paged_prefix_attention", "paged_prefix_span",
                        "paged_prefix_finish"}
    assert all(isinstance(at, Autotuner) for at in hot.values())
    assert all(at.cache_results is False for at in hot.values())
    assert hot["indexed_scan"].keys[-2:] == ["N_CLASS", "T_CLASS"]
    assert tuner.caches(ShapeClass.ROWS_FEW)["indexed_scan"].drop == {4, 5}
    assert tuner.caches(ShapeClass.ROWS_FEW)["chunk_fwd_o"].drop == frozenset()


def test_fla_autotuner_fills_the_class_cache(fla_tuner, monkeypatch):
    """fla's CachedAutotuner, called through its public wrapper, tunes into the active class only."""
    tuner, hot = fla_tuner
    at = hot["recompute_w_u"]
    launched = []

    class Launch:
        def run(self, *args, **kwargs):
            launched.append(kwargs["num_warps"])

    monkeypatch.setattr(at, "fn", Launch())
    # `do_bench` is a cached property: set the instance's value (getattr would ask for a GPU driver)
    monkeypatch.setitem(at.__dict__, "do_bench", lambda kernel_call, quantiles: (kernel_call(), [launched[-1]] * 3)[1])
    default = dict(at.cache)
    with tuner.use(ShapeClass.ROWS_MID):
        recompute_w_u()
    assert len(tuner.caches(ShapeClass.ROWS_MID)["recompute_w_u"]) == 1
    assert launched[-1] == min(c.num_warps for c in at.configs)  # the fake timing = num_warps: the fewest win
    assert dict(at.cache) == default
    assert len(tuner.caches(ShapeClass.ROWS_FEW)["recompute_w_u"]) == 0


def recompute_w_u():
    """fla's public wrapper of its WY recompute on three 32-token sequences (the kernel stubbed)."""
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd

    T, H, K = 96, 2, 16
    cu = torch.arange(4) * 32
    chunks = torch.stack([torch.arange(3), torch.zeros(3, dtype=torch.int64)], 1)
    recompute_w_u_fwd(torch.zeros(1, T, H, K), torch.zeros(1, T, H, K), torch.zeros(1, T, H), torch.zeros(1, T, H, 64),
                      torch.zeros(1, T, H), cu_seqlens=cu, chunk_indices=chunks)


class RecordingTuner:
    def __init__(self):
        self.classes = []

    @contextmanager
    def use(self, cls):
        self.classes.append(cls)
        yield


def test_runner_passes_run_in_their_class():
    model = random_model(tiny_config(), seed=0)
    bank = Bank.allocate(model.cfg, num_slots=4, num_blocks=64, block_size=16)
    tuner = RecordingTuner()
    runner = Passes(model, bank, get_ops("torch"), state_chunk_tokens=200, tuner=tuner)
    docs = [[1] * 300, [2] * 100]
    handles = [bank.alloc(len(d)) for d in docs]
    # chunks: (200 + 100 tokens, 2 docs: docs_few), then (100 tokens, 1 doc: rows_few, as every pass of <= 256)
    runner.state_pass(docs, handles)
    assert tuner.classes == [ShapeClass.DOCS_FEW, ShapeClass.ROWS_FEW]
    rows = [[3] * 30] * 12  # 360 row tokens
    batch = RowBatch.build(rows, [handles[0]] * 12, [300] * 12, [[29]] * 12)
    assert batch.row_lens == (30,) * 12 and batch.shape_class is ShapeClass.ROWS_MID
    runner.row_pass(batch)
    assert tuner.classes[-1] is ShapeClass.ROWS_MID


# --- tuning a class over several shapes ------------------------------------------------------------

# Made-up times (one stub launch) by shape (sequences, tokens in all) and BLOCK: the small shape
# prefers 16, the large 64, and the total over both prefers 32, best on neither.
SMALL, LARGE, WIDE_A, WIDE_B = (6, 192), (5, 160), (96, 6144), (96, 3072)
TIMES = {SMALL: {16: 1.0, 32: 1.2, 64: 3.0}, LARGE: {16: 5.0, 32: 2.0, 64: 1.5},
         WIDE_A: {16: 9.0, 32: 4.0, 64: 2.0}, WIDE_B: {16: 8.0, 32: 3.0, 64: 2.5}}


class ShapeBench:
    """`do_bench` stand-in: the time of the launched BLOCK on the current shape (`TIMES`)."""

    def __init__(self, launch: FakeLaunch):
        self.launch, self.calls, self.shape = launch, 0, None

    def __call__(self, kernel_call, quantiles):
        kernel_call()
        self.calls += 1
        t = TIMES[self.shape][self.launch.launches[-1]]
        return [t, t * 0.9, t * 1.1]


@pytest.fixture
def stub3():
    launch = FakeLaunch()
    bench = ShapeBench(launch)
    at = triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64)],
                         key=["H", "N_CLASS", "T_CLASS"], do_bench=bench, cache_results=True)(stub_kernel)
    at.fn = launch
    return at, launch, bench


def shape_pass(at, bench, shape):
    """One 'pass' of `shape` = (sequences, tokens in all): one launch of the stub."""
    def run():
        bench.shape = shape
        call(at, bench, *shape)
    return run


def test_class_shapes_belong_to_their_class():
    assert set(CLASS_SHAPES) == set(ShapeClass)
    for cls, shapes in CLASS_SHAPES.items():
        assert shapes and len(set(shapes)) == len(shapes)
        for s in shapes:
            # of the class's kind (row shapes for the rows' classes) and in its token range; a pass of
            # the shape with no class given (`PassMeta.pass_class`, as warm-up runs it) lands there too
            assert classify(s.seqs * s.tokens, rows=cls.rows) is cls, f"{s} is not {cls.value}"
            assert classify_seqs(s.seqs, s.seqs * s.tokens) is cls, f"{s} is not {cls.value} by its shape"
            assert s.prefix == 0 or cls.rows, "document shapes start from nothing"


def test_class_pick_minimises_the_total_over_its_shapes(stub3):
    at, launch, bench = stub3
    tuner = ClassTuner({"stub": at})
    pinned = tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL), shape_pass(at, bench, LARGE)])
    assert bench.calls == 6, "every config benchmarked on every shape"
    (config,) = tuner.caches(ShapeClass.ROWS_FEW)["stub"].values()
    assert config.kwargs == {"BLOCK": 32}, "the least total (3.2), not either shape's best (16 or 64)"
    assert [c.kwargs for c in pinned["stub"].values()] == [{"BLOCK": 32}]
    assert at.cache_results is False and len(at.cache) == 0, "the default cache was touched"
    with tuner.use(ShapeClass.ROWS_FEW):  # either shape, any own bucket: the pinned config, no tuning
        shape_pass(at, bench, SMALL)()
        shape_pass(at, bench, LARGE)()
        call(at, bench, 1, 16)
    assert bench.calls == 6 and launch.launches[-3:] == [32, 32, 32]


def test_a_pinned_config_runs_for_every_key_of_its_class_then_the_pick_comes_back(stub3):
    at, launch, bench = stub3
    tuner = ClassTuner({"stub": at})
    tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL), shape_pass(at, bench, LARGE)])
    tuner.tune(ShapeClass.ROWS_MID, [shape_pass(at, bench, WIDE_A)])
    before = {cls: tuner.chosen(cls) for cls in (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID)}
    sixteen = next(c for c in at.configs if c.kwargs["BLOCK"] == 16)
    with tuner.pinned(ShapeClass.ROWS_FEW, "stub", sixteen):
        with tuner.use(ShapeClass.ROWS_FEW):  # any own bucket of the class: the pinned config, no tuning
            shape_pass(at, bench, SMALL)()
            shape_pass(at, bench, LARGE)()
            call(at, bench, 1, 16)
        with tuner.use(ShapeClass.ROWS_MID):  # another class keeps its own pick
            shape_pass(at, bench, WIDE_A)()
    assert launch.launches[-4:] == [16, 16, 16, 64] and bench.calls == 9, "tuned only by the two `tune`s"
    assert {cls: tuner.chosen(cls) for cls in before} == before
    with pytest.raises(RuntimeError), tuner.pinned(ShapeClass.ROWS_FEW, "stub", sixteen):
        raise RuntimeError("a failed launch inside")
    assert tuner.chosen(ShapeClass.ROWS_FEW) == before[ShapeClass.ROWS_FEW]
    with tuner.use(ShapeClass.ROWS_FEW):
        shape_pass(at, bench, SMALL)()
    assert launch.launches[-1] == 32


def test_a_kernel_the_class_never_launches_needs_no_config(stub3, stub):
    at, launch, bench = stub3
    unused = stub[0]  # e.g. the delta-rule path a class does not take
    tuner = ClassTuner({"stub": at, "unused": unused})
    assert not tuner.tuned(ShapeClass.ROWS_FEW)
    tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL)])
    assert tuner.tuned(ShapeClass.ROWS_FEW) and len(tuner.caches(ShapeClass.ROWS_FEW)["unused"]) == 0
    assert tuner.tune(ShapeClass.ROWS_MID, [lambda: None]) == {} and not tuner.tuned(ShapeClass.ROWS_MID)


def test_each_class_keeps_its_own_pick(stub3):
    at, launch, bench = stub3
    tuner = ClassTuner({"stub": at})
    tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL), shape_pass(at, bench, LARGE)])
    tuner.tune(ShapeClass.ROWS_WIDE, [shape_pass(at, bench, WIDE_A), shape_pass(at, bench, WIDE_B)])
    tuner.tune(ShapeClass.DOCS_FEW, [shape_pass(at, bench, SMALL)])  # one shape: its own best
    assert tuner.chosen(ShapeClass.ROWS_FEW)["stub"][0].startswith("BLOCK: 32")
    assert tuner.chosen(ShapeClass.ROWS_WIDE)["stub"][0].startswith("BLOCK: 64")
    assert tuner.chosen(ShapeClass.DOCS_FEW)["stub"][0].startswith("BLOCK: 16")
    assert not tuner.tuned(ShapeClass.DOCS_WIDE) and len(at.cache) == 0
    with tuner.use(ShapeClass.ROWS_WIDE):
        shape_pass(at, bench, SMALL)()
    with tuner.use(ShapeClass.ROWS_FEW):
        shape_pass(at, bench, WIDE_A)()
    assert launch.launches[-2:] == [64, 32] and bench.calls == 15


def test_nothing_retunes_after_tuning_and_disk_cache_stays_off(stub3, monkeypatch):
    at, launch, bench = stub3

    def no_disk(*args, **kwargs):
        raise AssertionError("the on-disk autotune cache was consulted")

    monkeypatch.setattr(at, "check_disk_cache", no_disk)
    tuner = ClassTuner({"stub": at})
    tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL), shape_pass(at, bench, LARGE)])

    def no_bench(*args, **kwargs):
        raise AssertionError("autotuned after the class was tuned")

    monkeypatch.setattr(at, "_bench", no_bench)
    with tuner.use(ShapeClass.ROWS_FEW):
        for n, tokens in [(1, 16), (8, 8 * 128), (3, 3 * 7)]:  # other own buckets of the class
            call(at, bench, n, tokens)
    assert launch.launches[-3:] == [32] * 3
    monkeypatch.undo()  # benchmarks allowed again: a second tune of the class keeps its pick
    monkeypatch.setattr(at, "check_disk_cache", no_disk)
    assert tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, LARGE)]) == {}
    assert tuner.chosen(ShapeClass.ROWS_FEW)["stub"][0].startswith("BLOCK: 32")


def test_configs_compile_untimed_before_the_timed_run(stub3):
    """`tune` runs each shape twice: first every config once with no timing (the stub's benchmark
    is not called, the class cache stays empty), then the timed run that decides."""
    at, launch, bench = stub3
    tuner = ClassTuner({"stub": at})
    seen = []

    def shape_run():
        seen.append((bench.calls, len(launch.launches), len(tuner.caches(ShapeClass.ROWS_FEW)["stub"])))
        shape_pass(at, bench, SMALL)()

    tuner.tune(ShapeClass.ROWS_FEW, [shape_run])
    assert seen[0] == (0, 0, 0) and seen[1] == (0, 4, 0), "untimed round: 3 configs once, then the launch"
    assert bench.calls == 3 and at.do_bench is bench, "the timed round used the kernel's own benchmark"
    assert tuner.chosen(ShapeClass.ROWS_FEW)["stub"][0].startswith("BLOCK: 16"), "SMALL's fastest"


def test_tuner_bench_times_the_timed_run_only(stub3):
    """A tuner's `bench` (serving: CUDA-graph replay) replaces every autotuner's own benchmarker in
    the timed round only, decides from its timings, and is put back afterwards."""
    at, launch, bench = stub3
    times, timed_calls = {16: 3.0, 32: 1.0, 64: 2.0}, []  # this benchmarker prefers 32 on SMALL (TIMES: 16)

    def timed(kernel_call, quantiles):
        kernel_call()
        timed_calls.append(launch.launches[-1])
        return [times[launch.launches[-1]]] * len(quantiles)

    tuner = ClassTuner({"stub": at}, bench=timed)
    tuner.tune(ShapeClass.ROWS_FEW, [shape_pass(at, bench, SMALL)])
    assert timed_calls == [16, 32, 64] and bench.calls == 0, "every config timed by the tuner's bench only"
    assert tuner.chosen(ShapeClass.ROWS_FEW)["stub"][0].startswith("BLOCK: 32")
    assert at.do_bench is bench, "the kernel's own benchmarker is back"


def test_pick_is_deterministic_given_the_timings():
    c16, c32, c64 = (triton.Config({"BLOCK": b}) for b in (16, 32, 64))
    tie = [{c64: 2.0, c32: 1.0, c16: 1.0}, {c16: 1.0, c32: 1.0, c64: 0.0}]
    assert pick_config(tie, [c16, c32, c64]) is c16, "equal totals: the kernel's earlier config"
    assert pick_config(tie, [c32, c16, c64]) is c32
    assert pick_config([{c16: 1.0, c32: 2.0}, {c16: math.inf, c32: 2.0}], [c16, c32]) is c32, "failed on a shape"
    assert pick_config([{c16: 1.0, c32: 2.0}, {c32: 2.0}], [c16, c32]) is c32, "not timed on a shape"
    fresh = [triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})]  # other objects, same configs
    assert pick_config([{fresh[0]: 3.0, fresh[1]: 1.0}, {c16: 1.0, c32: 1.0}], [c16, c32]) is c32
    with pytest.raises(ValueError, match="no config"):
        pick_config([{}, {}], [c16])


def test_tuning_is_repeatable(stub3):
    at, _, bench = stub3
    picks = []
    for _ in range(3):
        tuner = ClassTuner({"stub": at})
        tuner.tune(ShapeClass.ROWS_MID, [shape_pass(at, bench, LARGE), shape_pass(at, bench, SMALL)])
        picks.append(tuner.chosen(ShapeClass.ROWS_MID))
    assert picks == [picks[0]] * 3 and picks[0]["stub"][0].startswith("BLOCK: 32")


def test_fla_autotuner_tunes_over_the_class_shapes(fla_tuner, monkeypatch):
    """fla's CachedAutotuner leaves its timings where `tune` reads them: shape A's time is the
    config's num_warps, shape B's 16 / num_warps; the least total is 4 warps (8 vs 10 or more)."""
    tuner, hot = fla_tuner
    at = hot["recompute_w_u"]
    launched, shape = [], {}

    class Launch:
        def run(self, *args, **kwargs):
            launched.append(kwargs["num_warps"])

    def bench(kernel_call, quantiles):
        kernel_call()
        w = launched[-1]
        return [w if shape["a"] else 16 / w] * 3

    monkeypatch.setattr(at, "fn", Launch())
    monkeypatch.setitem(at.__dict__, "do_bench", bench)
    warps = sorted({c.num_warps for c in at.configs})
    assert warps[0] < 4 < warps[-1], warps
    def run(a):
        def go():
            shape["a"] = a
            recompute_w_u()
        return go

    default = dict(at.cache)
    pinned = tuner.tune(ShapeClass.ROWS_MID, [run(True), run(False)])
    assert [c.num_warps for c in pinned["recompute_w_u"].values()] == [4]
    assert [c.num_warps for c in tuner.caches(ShapeClass.ROWS_MID)["recompute_w_u"].values()] == [4]
    assert dict(at.cache) == default


class StubModel:
    """Stands in for the model in `warm_up`: each pass is one launch of the stub, timed by its shape."""

    def __init__(self, at, bench):
        self.at, self.bench, self.cfg, self.passes = at, bench, SimpleNamespace(vocab_size=50), []

    def __call__(self, tokens, meta, pools, ops, picks):
        n = meta.cu_seqlens.numel() - 1
        shape = ClassShape(n, tokens.numel() // n, int(meta.prefix_lens[0]))
        self.passes.append((shape, int(meta.read_slots[0]), int(meta.write_slots[0])))
        self.bench.shape = {(6, 32, 48): SMALL, (5, 32, 2200): LARGE}.get((shape.seqs, shape.tokens, shape.prefix),
                                                                          SMALL if shape.seqs * shape.tokens < 1000
                                                                          else WIDE_A)
        call(self.at, self.bench, n, tokens.numel())


def stub_runner(at, bench):
    bank = SimpleNamespace(block_table=torch.zeros(4, 40, dtype=torch.int32),
                           pools=SimpleNamespace(block_size=64, num_blocks=100))  # 2,560 tokens a slot
    return SimpleNamespace(device=torch.device("cpu"), bank=bank, model=StubModel(at, bench), ops=None,
                           tuner=ClassTuner({"stub": at}))


def test_warm_up_tunes_each_class_over_its_shapes(stub3, monkeypatch):
    at, _, bench = stub3
    monkeypatch.setitem(CLASS_SHAPES, ShapeClass.ROWS_FEW, (ClassShape(6, 32, 48), ClassShape(5, 32, 2200)))
    runner = stub_runner(at, bench)
    assert warm_up(runner, [ShapeClass.ROWS_FEW], row_slot=2, row_prefix=2200) == [ShapeClass.ROWS_FEW]
    # each shape twice: its untimed compile run, then the timed one
    assert runner.model.passes == [(ClassShape(6, 32, 48), 2, -1)] * 2 + [(ClassShape(5, 32, 2200), 2, -1)] * 2
    assert runner.tuner.chosen(ShapeClass.ROWS_FEW)["stub"][0].startswith("BLOCK: 32")
    assert bench.calls == 6
    no_slot = stub_runner(at, bench)  # a scorer: no slot read, the prefixes kept (synthetic pages)
    warm_up(no_slot, [ShapeClass.ROWS_FEW])
    assert no_slot.model.passes == [(ClassShape(6, 32, 48), -1, -1)] * 2 + [(ClassShape(5, 32, 2200), -1, -1)] * 2
    assert no_slot.tuner.chosen(ShapeClass.ROWS_FEW) == runner.tuner.chosen(ShapeClass.ROWS_FEW)
    gathered = stub_runner(at, bench)  # ops that hold at most 48 prefix tokens a row: warmed at that
    gathered.ops = SimpleNamespace(max_prefix_tokens=48)
    warm_up(gathered, [ShapeClass.ROWS_FEW])
    assert gathered.model.passes == [(ClassShape(6, 32, 48), -1, -1)] * 2 + [(ClassShape(5, 32, 48), -1, -1)] * 2


def test_warm_shapes_cut_prefixes_to_the_stored_document():
    few = CLASS_SHAPES[ShapeClass.ROWS_FEW]
    assert warm_shapes(ShapeClass.ROWS_FEW, row_slot=3, row_prefix=5000) == list(few)
    cut = warm_shapes(ShapeClass.ROWS_FEW, row_slot=3, row_prefix=1000)
    assert [(s.seqs, s.tokens) for s in cut] == [(s.seqs, s.tokens) for s in few]
    assert [s.prefix for s in cut] == [min(s.prefix, 1000) for s in few]
    # shapes the cut makes equal are warmed once
    assert warm_shapes(ShapeClass.ROWS_FEW, row_slot=3, row_prefix=300) == [ClassShape(1, 16), ClassShape(4, 40, 300)]
    assert warm_shapes(ShapeClass.ROWS_MID) == list(CLASS_SHAPES[ShapeClass.ROWS_MID]), "no slot: prefixes kept"
    same = ClassShape(4, 32, 0)
    assert len({same, ClassShape(4, 32)}) == 1


def test_config_map_entry_totals_over_the_class_shapes():
    from bench.autotune_map import class_entry

    shapes = {"6x32@48": ({"a": 1.0, "b": 1.5}, "b"), "5x32@2200": ({"a": 10.0, "b": 8.0}, "b")}
    e = class_entry("k", ShapeClass.ROWS_FEW, shapes, "a")
    assert (e["kernel"], e["shape_class"], e["best_config"]) == ("k", "rows_few", "b")
    assert (e["best_us"], e["chosen_us"], e["first_call_pick_us"]) == (9.5, 9.5, 11.0)
    assert e["chosen_over_best"] == 1.0 and e["chosen_configs"] == ["b"]
    assert [d["chosen_over_best"] for d in e["shapes"]] == [1.5, 1.0], "the per-shape view keeps each shape's miss"
    assert class_entry("k", ShapeClass.ROWS_FEW, shapes, None)["first_call_pick_us"] is None


def test_warm_pass_without_a_slot_reads_synthetic_pages(stub3, monkeypatch):
    """A scorer warms rows over a prefix it cannot store: attention reads real bank pages through a
    synthetic table (distinct pages per row, inside the pool), recurrent/conv states start empty."""
    at, _, bench = stub3
    monkeypatch.setitem(CLASS_SHAPES, ShapeClass.ROWS_FEW, (ClassShape(5, 32, 2200), ClassShape(2, 16, 4000)))
    runner = stub_runner(at, bench)
    seen = []
    model = runner.model
    runner.model = lambda tokens, meta, pools, ops, picks: (seen.append(meta), model(tokens, meta, pools, ops, picks))
    runner.model.cfg = model.cfg
    warm_up(runner, [ShapeClass.ROWS_FEW])
    first, _, capped, _ = seen  # each shape twice: untimed compile, then timed
    assert first.prefix_lens.tolist() == [2200] * 5 and first.read_slots.tolist() == [-1] * 5
    pages = first.block_table[:, :35]  # 2,200 tokens = 35 pages of 64
    assert first.block_table.dtype == torch.int32 and int(pages.max()) < 100 and int(pages.min()) >= 0
    assert all(len(set(row.tolist())) == 35 for row in pages), "a row's pages are distinct"
    assert capped.prefix_lens.tolist() == [40 * 64] * 2, "capped at what a slot can hold"
