"""The pointer decision head: the one home of its maths and of its file format.

Maths (docs/design.md section 1). For a question with decide state h_d and option states h_1..h_K (the
backbone's final, normed hidden states at `<decide>` and at each `</opt>`):

    q   = W_q h_d + b_q                      [R]   (R = 256 for Kev heads)
    k_i = W_k h_i + b_k                      [R]
    z_i = (k_i . q) / sqrt(R) / temperature
    p   = softmax(z) over the question's own options

always in fp32 (inputs are cast; weights are stored fp32). A pass's questions are batched: options
of all questions are concatenated in question order, and `option_counts` says how many belong to
each question. The segment softmax scatters the flat logits into a dense [Q, max K] table padded
with -inf and takes a row softmax: no loop over options or questions, no atomics (so results are
deterministic on GPU), and only host ints (the counts come from the prompts) decide the layout.
Note: a process that enables TF32 matmuls globally would also lower the two projections here.

Answers (`answer`): see kev.request.api for the semantics; argmax ties go to the first option/lowest level.

File format `head.safetensors` (safetensors, never pickle):

    w_q          [R, d]   float (any float dtype; loaded as fp32)
    w_k          [R, d]
    b_q          [R]      optional
    b_k          [R]      optional
    temperature  [] or [1], finite and > 0
    metadata     {"format": "kev-decision-head", "version": "1"}

d must equal the backbone's hidden size. A file without metadata is accepted (heads converted by
other tools); one whose metadata names another format or version is not. A Kev training run's
pickled `head.pt` is never read here: `kev convert` (kev/model/convert.py, docs/models.md) reads it
with torch's restricted unpickler, checks it and writes this file. Any other tensor name is
an error, so a wrong file (e.g. model weights) fails loudly. Errors are `CheckpointError`s naming
the file and the tensor.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kev.request.api import Answer, ChoiceAnswer, NoulAnswer, Question, QuestionType, ScoreAnswer
from kev.model.config import CheckpointError
from kev.ops.invariant import tiled_linear
from kev.exec.transfer import to_device

HEAD_FORMAT = "kev-decision-head"
HEAD_VERSION = "1"
_REQUIRED = ("w_q", "w_k", "temperature")
_OPTIONAL = ("b_q", "b_k")


@dataclass(frozen=True, eq=False)  # eq would compare tensors elementwise
class DecisionHead:
    w_q: torch.Tensor  # [R, d] fp32
    w_k: torch.Tensor  # [R, d] fp32
    b_q: torch.Tensor | None  # [R] fp32
    b_k: torch.Tensor | None  # [R] fp32
    temperature: float

    def __post_init__(self) -> None:
        r, d = self.w_q.shape
        if self.w_k.shape != (r, d):
            raise ValueError(f"w_k shape {tuple(self.w_k.shape)} != w_q shape {(r, d)}")
        for name in _OPTIONAL:
            b = getattr(self, name)
            if b is not None and b.shape != (r,):
                raise ValueError(f"{name} shape {tuple(b.shape)} != ({r},)")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        for name in ("w_q", "w_k", *_OPTIONAL):
            t = getattr(self, name)
            if t is not None and t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 (the head runs in fp32), got {t.dtype}")

    @property
    def hidden_size(self) -> int:
        return self.w_q.shape[1]

    @property
    def proj_dim(self) -> int:
        return self.w_q.shape[0]

    def to(self, device: str | torch.device) -> "DecisionHead":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return DecisionHead(move(self.w_q), move(self.w_k), move(self.b_q), move(self.b_k), self.temperature)

    def logits(self, h_decide: torch.Tensor, h_opts: torch.Tensor, option_counts: Sequence[int]) -> torch.Tensor:
        """Flat fp32 logits [O], question after question.

        h_decide: [Q, d] any float dtype, one row per question.
        h_opts:   [O, d], the options of question 0, then of question 1, ...; O = sum(option_counts).
        option_counts: Q host ints >= 1.
        """
        seg, _ = self._segments(h_decide, h_opts, option_counts)
        return self._logits(h_decide, h_opts, seg)

    def probabilities(
        self, h_decide: torch.Tensor, h_opts: torch.Tensor, option_counts: Sequence[int]
    ) -> torch.Tensor:
        """Flat fp32 probabilities [O]: a softmax within each question's options (shapes as `logits`)."""
        seg, col = self._segments(h_decide, h_opts, option_counts)
        return self.probabilities_at(h_decide, h_opts, seg, col, max(option_counts, default=0))

    def probabilities_at(self, h_decide: torch.Tensor, h_opts: torch.Tensor, seg: torch.Tensor, col: torch.Tensor,
                         widest: int) -> torch.Tensor:
        """`probabilities` with the segments of `segments` already on the device (`widest`: the
        most options of a question). The scorer's row worker moves them in one copy with its other
        indices: it runs this between launches, where every host op may wait for the GIL."""
        z = self._logits(h_decide, h_opts, seg)
        table = z.new_full((h_decide.shape[0], widest), -math.inf)  # [Q, Kmax]
        table[seg, col] = z
        return torch.softmax(table, dim=-1)[seg, col]  # [Q, Kmax] -> [O]

    def pick_probabilities(self, hidden: torch.Tensor, owner: torch.Tensor, table_row: torch.Tensor,
                           table_col: torch.Tensor, width: int) -> torch.Tensor:
        """The head over every pick of a static-shape pass (a CUDA graph's; layout: `pick_layout`):
        [P] fp32, each option pick's probability within its question (other picks: meaningless).
        hidden [P, d]; owner [P]: the pick holding each pick's question's `<decide>`; table_row /
        table_col [P]: an option's cell in the [1 + P, width] logit table (row 1 + its decide
        pick, column its option index), every other pick's in row 0, outside every softmax.
        The maths of `probabilities`, but the projections run on all P picks and each softmax over
        `width` columns: a graph's shapes cannot follow the pass, so the low bits may differ from
        the eager head's (each exact to fp32 rounding)."""
        P = hidden.shape[0]
        h = hidden.float()
        q = tiled_linear(h, self.w_q, self.b_q)  # [P, R]: only the decide picks' rows are read
        k = tiled_linear(h, self.w_k, self.b_k)  # [P, R]
        z = (k * q[owner]).sum(-1) / math.sqrt(self.proj_dim) / self.temperature  # [P]
        table = z.new_full((1 + P, width), -math.inf)
        table[table_row, table_col] = z
        return torch.softmax(table[1:], dim=-1)[(table_row - 1).clamp(min=0), table_col]

    def _logits(self, h_decide: torch.Tensor, h_opts: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
        # Fixed row tiles: a question's logits must not depend on how many share the pass (kev.ops.invariant).
        q = tiled_linear(h_decide.float(), self.w_q, self.b_q)  # [Q, d] @ [d, R] -> [Q, R]
        k = tiled_linear(h_opts.float(), self.w_k, self.b_k)  # [O, d] @ [d, R] -> [O, R]
        dots = (k * q[seg]).sum(-1)  # [O, R] * [O, R] -> [O]
        return dots / math.sqrt(self.proj_dim) / self.temperature

    def _segments(
        self, h_decide: torch.Tensor, h_opts: torch.Tensor, option_counts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(question index, option index within its question) of every flat option, on h_opts' device."""
        d = self.hidden_size
        if h_decide.ndim != 2 or h_decide.shape[1] != d or h_opts.ndim != 2 or h_opts.shape[1] != d:
            raise ValueError(
                f"h_decide {tuple(h_decide.shape)} and h_opts {tuple(h_opts.shape)} must be [Q, {d}] and [O, {d}]"
            )
        counts = [int(c) for c in option_counts]
        if len(counts) != h_decide.shape[0] or min(counts, default=1) < 1 or sum(counts) != h_opts.shape[0]:
            raise ValueError(
                f"option_counts {counts} must hold one count >= 1 per h_decide row ({h_decide.shape[0]}) "
                f"summing to the h_opts rows ({h_opts.shape[0]})"
            )
        seg, col = segments(counts)
        both = to_device(torch.tensor([seg, col], dtype=torch.long), h_opts.device)  # no wait for the GPU
        return both[0], both[1]


def segments(option_counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Host ints: the question of every flat option, and its index within that question."""
    seg = [q for q, n in enumerate(option_counts) for _ in range(n)]
    col = [i for n in option_counts for i in range(n)]
    return seg, col


def pick_layout(option_counts: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Host ints of `DecisionHead.pick_probabilities`' layout for rows whose picks are [decide,
    option ends...] each, in row order: (owner, table_row, table_col) per pick. Padding picks
    after them take (0, 0, 0): row 0 is outside every softmax."""
    owner, row, col = [], [], []
    i = 0
    for n in option_counts:
        owner.extend(repeat(i, n + 1))
        row.append(0)
        row.extend(repeat(i + 1, n))
        col.append(0)
        col.extend(range(n))
        i += n + 1
    return owner, row, col


def answer(question: Question, probs: Sequence[float] | torch.Tensor) -> Answer:
    """The answer to one question from its option probabilities (rendered option order)."""
    p = [float(x) for x in (probs.tolist() if isinstance(probs, torch.Tensor) else probs)]
    if question.type is QuestionType.NOUL:
        if len(p) != 2:
            raise ValueError(f"a noul question has 2 options (no, yes), got {len(p)} probabilities")
        return NoulAnswer(p_yes=p[1])
    names = [c.name for c in question.options] if question.type is QuestionType.CHOICE else list(question.levels)
    if len(p) != len(names):
        raise ValueError(f"{len(names)} options but {len(p)} probabilities")
    mode = max(range(len(p)), key=p.__getitem__)  # max() keeps the first of equal keys: ties -> first
    n = len(p)
    if question.type is QuestionType.CHOICE:
        confidence = 1.0 if n == 1 else (p[mode] - 1 / n) / (1 - 1 / n)
        return ChoiceAnswer(choice=names[mode], probabilities=dict(zip(names, p)), confidence=confidence)
    expected = sum(i * pi for i, pi in enumerate(p))
    spread = sum(pi * abs(i - mode) for i, pi in enumerate(p))  # E|level - mode|
    confidence = 1.0 if n == 1 else 1 - spread / (n - 1)
    return ScoreAnswer(score=expected, legend=tuple(names), probabilities=tuple(p), confidence=confidence)


def answers(questions: Sequence[Question], probs: torch.Tensor | Sequence[float],
            option_counts: Sequence[int]) -> list[Answer]:
    """Answers of a pass: `probs` [O] from `DecisionHead.probabilities` (a tensor: one device->host
    copy) or the same floats already on the host."""
    flat = probs.tolist() if isinstance(probs, torch.Tensor) else list(probs)
    out, start = [], 0
    for question, count in zip(questions, option_counts, strict=True):
        out.append(answer(question, flat[start : start + count]))
        start += count
    return out


# ---------------------------------------------------------------------------------------------
# head.safetensors


def save_head(path: str | os.PathLike[str], head: DecisionHead) -> None:
    tensors = {
        "w_q": head.w_q.detach().float().cpu().contiguous(),
        "w_k": head.w_k.detach().float().cpu().contiguous(),
        "temperature": torch.tensor(head.temperature, dtype=torch.float32),
    }
    for name in _OPTIONAL:
        if (b := getattr(head, name)) is not None:
            tensors[name] = b.detach().float().cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": HEAD_FORMAT, "version": HEAD_VERSION})


def load_head(path: str | os.PathLike[str], hidden_size: int, device: str | torch.device = "cpu") -> DecisionHead:
    """Reads and checks a head file against the backbone's `hidden_size`; tensors as fp32 on `device`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: decision head file not found")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    if meta.get("format", HEAD_FORMAT) != HEAD_FORMAT or meta.get("version", HEAD_VERSION) != HEAD_VERSION:
        raise CheckpointError(
            f"{path}: metadata {meta} is not format {HEAD_FORMAT!r} version {HEAD_VERSION!r}"
        )
    if unknown := sorted(set(tensors) - set(_REQUIRED) - set(_OPTIONAL)):
        raise CheckpointError(f"{path}: unexpected tensor {unknown[0]!r} (a head holds w_q, w_k, b_q, b_k, temperature)")
    if missing := [n for n in _REQUIRED if n not in tensors]:
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r}")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float type")

    w_q = tensors["w_q"]
    if w_q.ndim != 2 or w_q.shape[1] != hidden_size:
        raise CheckpointError(f"{path}: tensor 'w_q' has shape {list(w_q.shape)}, expected [R, {hidden_size}]")
    r = w_q.shape[0]
    expected = {"w_k": [r, hidden_size], "b_q": [r], "b_k": [r]}
    for name, shape in expected.items():
        if name in tensors and list(tensors[name].shape) != shape:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, expected {shape}")
    temp = tensors["temperature"]
    if temp.numel() != 1 or temp.ndim > 1:
        raise CheckpointError(f"{path}: tensor 'temperature' has shape {list(temp.shape)}, expected [] or [1]")
    temperature = float(temp.float().reshape(()))
    if not (math.isfinite(temperature) and temperature > 0):
        raise CheckpointError(f"{path}: tensor 'temperature' is {temperature}, expected finite and > 0")

    fp32 = lambda name: tensors[name].to(device=device, dtype=torch.float32) if name in tensors else None  # noqa: E731
    return DecisionHead(fp32("w_q"), fp32("w_k"), fp32("b_q"), fp32("b_k"), temperature)
