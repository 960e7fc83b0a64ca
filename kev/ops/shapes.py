"""Shape classes: which autotune cache a pass uses, decided from host ints (sequence count and
token count) known when the pass is built, and the shapes each class is tuned on. The tuner that
acts on them is `kev.ops.autotune`; the kernels' own finer buckets are `kev.ops.utils.shape_class`."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ROW_TOKENS = 128  # mean tokens per sequence up to which a pass is row-like


class ShapeClass(enum.Enum):
    """Which autotune cache a pass uses. Mean sequence length splits rows from documents."""

    ROWS_FEW = "rows_few"  # <= 8 sequences of <= 128 tokens: one request's rows, a short new document
    ROWS_MID = "rows_mid"  # 9-32 such sequences
    ROWS_WIDE = "rows_wide"  # > 32: wide row batches (96 x 32-64)
    DOCS_FEW = "docs_few"  # <= 4 sequences of > 128 tokens: long single documents (chunks of 8k)
    DOCS_WIDE = "docs_wide"  # > 4: batched new documents (16 x 2,048)

    @property
    def rows(self) -> bool:
        return self in (ShapeClass.ROWS_FEW, ShapeClass.ROWS_MID, ShapeClass.ROWS_WIDE)


@dataclass(frozen=True)
class ClassShape:
    """One shape a class is tuned on: `seqs` sequences of `tokens` tokens each, each continuing
    `prefix` stored tokens (rows over a cached document; 0: a new document)."""

    seqs: int
    tokens: int
    prefix: int = 0

    def __str__(self) -> str:
        return f"{self.seqs}x{self.tokens}@{self.prefix}"


# The shapes each class is tuned on (`warm_up`, `ClassTuner.tune`) and measured on
# (bench/autotune_map.py), from the H200 map's served shapes: rows_few the tiny first call / short
# new document, six-short's rows (6 x 32 over a 48-token document; paged attention wants 8 warps
# there, 4 over 2,200 tokens) and five-long's (5 x 32 over 2,200); rows_mid and rows_wide both ends
# of the width they serve; docs_few a 2,200-token document and a full 8k chunk; docs_wide 16
# documents of 2,048. Each shape costs about 5 s of warm-up on the H200 (every config of every hot
# kernel, Triton's benchmarker), so a class keeps 1-3.
CLASS_SHAPES: dict[ShapeClass, tuple[ClassShape, ...]] = {
    ShapeClass.ROWS_FEW: (ClassShape(1, 16), ClassShape(6, 32, 48), ClassShape(5, 32, 2200)),
    ShapeClass.ROWS_MID: (ClassShape(16, 64, 2200), ClassShape(32, 64, 2200)),
    ShapeClass.ROWS_WIDE: (ClassShape(96, 32, 2200), ClassShape(96, 64, 2200)),
    ShapeClass.DOCS_FEW: (ClassShape(1, 2200), ClassShape(1, 8192)),
    ShapeClass.DOCS_WIDE: (ClassShape(16, 2048),),
}


def classify(num_seqs: int, num_tokens: int) -> ShapeClass:
    """The class of a pass of `num_seqs` sequences and `num_tokens` tokens in all (host ints:
    tensor shapes or the lengths a batch was built from, never a device read)."""
    if num_seqs <= 0:
        raise ValueError(f"a pass needs at least one sequence, got num_seqs={num_seqs}")
    if num_tokens <= ROW_TOKENS * num_seqs:
        if num_seqs <= 8:
            return ShapeClass.ROWS_FEW
        return ShapeClass.ROWS_MID if num_seqs <= 32 else ShapeClass.ROWS_WIDE
    return ShapeClass.DOCS_FEW if num_seqs <= 4 else ShapeClass.DOCS_WIDE


def classify_lens(lens: Iterable[int]) -> ShapeClass:
    lens = list(lens)
    return classify(len(lens), sum(lens))


def classify_cu_seqlens(cu_seqlens: torch.Tensor | list[int]) -> ShapeClass:
    """From a host `cu_seqlens` ([N + 1]); a device tensor would need a sync: use the shapes instead."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError("cu_seqlens must be on the host; classify device batches by their shapes")
        cu_seqlens = cu_seqlens.tolist()
    return classify(len(cu_seqlens) - 1, cu_seqlens[-1] - cu_seqlens[0])
