"""Shape-class autotune caches (kev.ops.autotune), on CPU with stubbed kernels.

A real `triton.autotune`d kernel whose launches are stubbed out (`fn.run` records the config,
`do_bench` returns made-up timings in which small passes prefer BLOCK 16 and wide ones BLOCK 32)
shows: the class comes from cu_seqlens / batch sizes, the on-disk cache is off, each class keeps
its own cache (a tiny first call does not decide a wide pass), inside a class the kernel's own
(N_CLASS, T_CLASS) buckets do not re-tune, and the default caches come back afterwards. Then the
same with fla's real autotuners (found by `hot_autotuners`) and the Runner's use of the tuner.
"""

from contextlib import contextmanager

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from kev.bank.bank import Bank
from kev.ops import get_ops
from kev.ops.autotune import ClassTuner, ShapeClass, classify, classify_cu_seqlens, classify_lens, hot_autotuners
from kev.runner import RowBatch, Runner
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


# one representative per class boundary side: what changes the cache a pass uses
@pytest.mark.parametrize("lens,cls", [
    ([16], ShapeClass.ROWS_FEW), ([32] * 6, ShapeClass.ROWS_FEW), ([64] * 8, ShapeClass.ROWS_FEW),
    ([48] * 9, ShapeClass.ROWS_MID), ([32] * 32, ShapeClass.ROWS_MID), ([64] * 33, ShapeClass.ROWS_WIDE),
    ([32] * 96, ShapeClass.ROWS_WIDE), ([129], ShapeClass.DOCS_FEW), ([2200], ShapeClass.DOCS_FEW),
    ([8192] * 4, ShapeClass.DOCS_FEW), ([2048] * 16, ShapeClass.DOCS_WIDE), ([300] * 5, ShapeClass.DOCS_WIDE),
], ids=lambda v: str(v) if isinstance(v, ShapeClass) else f"{len(v)}x{v[0]}")
def test_class_from_cu_seqlens_and_batch_size(lens, cls):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    assert classify_cu_seqlens(cu) is cls
    assert classify_cu_seqlens(cu.tolist()) is cls
    assert classify_lens(lens) is cls
    assert classify(len(lens), sum(lens)) is cls


def test_classify_rejects_empty_and_device_cu_seqlens():
    with pytest.raises(ValueError, match="at least one sequence"):
        classify(0, 0)
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
    assert set(hot) == {"indexed_conv", "l2norm_heads", "chunk_local_cumsum", "kkt_solve", "recompute_w_u",
                        "indexed_scan", "chunk_fwd_o", "paged_prefix_attention"}
    assert all(isinstance(at, Autotuner) for at in hot.values())
    assert all(at.cache_results is False for at in hot.values())
    assert hot["indexed_scan"].keys[-2:] == ["N_CLASS", "T_CLASS"]
    assert tuner.caches(ShapeClass.ROWS_FEW)["indexed_scan"].drop == {4, 5}
    assert tuner.caches(ShapeClass.ROWS_FEW)["chunk_fwd_o"].drop == frozenset()


def test_fla_autotuner_fills_the_class_cache(fla_tuner, monkeypatch):
    """fla's CachedAutotuner, called through its public wrapper, tunes into the active class only."""
    from fla.ops.utils.cumsum import chunk_local_cumsum

    tuner, hot = fla_tuner
    at = hot["chunk_local_cumsum"]
    launched = []

    class Launch:
        def run(self, *args, **kwargs):
            launched.append(kwargs["num_warps"])

    monkeypatch.setattr(at, "fn", Launch())
    # `do_bench` is a cached property: set the instance's value (getattr would ask for a GPU driver)
    monkeypatch.setitem(at.__dict__, "do_bench", lambda kernel_call, quantiles: (kernel_call(), [launched[-1]] * 3)[1])
    g = torch.zeros(1, 96, 4)
    cu = torch.arange(4) * 32
    chunks = torch.stack([torch.arange(3), torch.zeros(3, dtype=torch.int64)], 1)
    default = dict(at.cache)
    with tuner.use(ShapeClass.ROWS_MID):
        chunk_local_cumsum(g=g, chunk_size=64, cu_seqlens=cu, chunk_indices=chunks)
    assert len(tuner.caches(ShapeClass.ROWS_MID)["chunk_local_cumsum"]) == 1
    assert launched[-1] == 1  # the fake timing = num_warps: the fewest warps win
    assert dict(at.cache) == default
    assert len(tuner.caches(ShapeClass.ROWS_FEW)["chunk_local_cumsum"]) == 0


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
    runner = Runner(model, bank, get_ops("torch"), state_chunk_tokens=200, tuner=tuner)
    docs = [[1] * 300, [2] * 100]
    handles = [bank.alloc(len(d)) for d in docs]
    runner.state_pass(docs, handles)  # chunks: (200 + 100 tokens, 2 docs), then (100 tokens, 1 doc)
    assert tuner.classes == [ShapeClass.DOCS_FEW, ShapeClass.ROWS_FEW]
    rows = [[3] * 20] * 12
    batch = RowBatch.build(rows, [handles[0]] * 12, [300] * 12, [[19]] * 12)
    assert batch.row_lens == (20,) * 12 and batch.shape_class is ShapeClass.ROWS_MID
    runner.row_pass(batch)
    assert tuner.classes[-1] is ShapeClass.ROWS_MID
