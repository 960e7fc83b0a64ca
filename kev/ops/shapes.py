"""Shape classes: which autotune cache a pass uses, decided from host ints (sequence count and
token count) known when the pass is built, and the shapes each class is tuned on. The tuner that
acts on them is `kev.ops.autotune`; the kernels' own finer buckets are `kev.ops.utils.shape_class`."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ROW_TOKENS = 128  # mean tokens per sequence up to which a pass of unknown kind is taken for rows


class ShapeClass(enum.Enum):
    """Which autotune cache a pass uses: the pass's kind and its (padded) token count, the two
    things a CUDA-graph key fixes, so a key's graph and every pass it serves share one class."""

    ROWS_FEW = "rows_few"  # row passes of <= 256 tokens (one or a few requests); state passes too
    ROWS_MID = "rows_mid"  # row passes of 257-1,024 tokens
    ROWS_WIDE = "rows_wide"  # row passes of > 1,024 tokens (a busy scorer's)
    DOCS_FEW = "docs_few"  # state passes of 257-4,096 tokens
    DOCS_WIDE = "docs_wide"  # state passes of > 4,096 tokens (batched documents, long chunks)

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
# (bench/autotune_map.py). Chosen from each class's token range, not from any workload: rows of
# 40 tokens (about the geometric middle of 12-128) over a 512-token and a 4,096-token prefix at the
# middle and the top of the class's range; documents of 1,024 and 4,096 tokens. Each shape costs
# about 5 s of warm-up on the H200 (every config of every hot kernel), so a class keeps 2-3.
CLASS_SHAPES: dict[ShapeClass, tuple[ClassShape, ...]] = {
    ShapeClass.ROWS_FEW: (ClassShape(1, 16), ClassShape(4, 40, 512), ClassShape(4, 40, 4096)),
    ShapeClass.ROWS_MID: (ClassShape(16, 40, 512), ClassShape(16, 40, 4096)),
    ShapeClass.ROWS_WIDE: (ClassShape(64, 40, 512), ClassShape(64, 40, 4096)),
    ShapeClass.DOCS_FEW: (ClassShape(1, 1024), ClassShape(1, 4096)),
    ShapeClass.DOCS_WIDE: (ClassShape(4, 2048), ClassShape(1, 8192)),
}


def classify(num_tokens: int, *, rows: bool) -> ShapeClass:
    """The class of a row pass (`rows`) or a state pass of `num_tokens` tokens in all (host ints:
    a key's padded size or the lengths a batch was built from, never a device read)."""
    if num_tokens <= 0:
        raise ValueError(f"a pass needs at least one token, got num_tokens={num_tokens}")
    if num_tokens <= 256:
        return ShapeClass.ROWS_FEW
    if rows:
        return ShapeClass.ROWS_MID if num_tokens <= 1024 else ShapeClass.ROWS_WIDE
    return ShapeClass.DOCS_FEW if num_tokens <= 4096 else ShapeClass.DOCS_WIDE


def classify_seqs(num_seqs: int, num_tokens: int) -> ShapeClass:
    """A pass whose kind is not known: rows when its sequences average at most ROW_TOKENS tokens."""
    return classify(num_tokens, rows=num_tokens <= ROW_TOKENS * max(num_seqs, 1))


def classify_lens(lens: Iterable[int]) -> ShapeClass:
    lens = list(lens)
    return classify_seqs(len(lens), sum(lens))


def classify_cu_seqlens(cu_seqlens: torch.Tensor | list[int]) -> ShapeClass:
    """From a host `cu_seqlens` ([N + 1]); a device tensor would need a sync: use the shapes instead."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError("cu_seqlens must be on the host; classify device batches by their shapes")
        cu_seqlens = cu_seqlens.tolist()
    return classify_seqs(len(cu_seqlens) - 1, cu_seqlens[-1] - cu_seqlens[0])
