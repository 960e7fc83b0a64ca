"""A pass's picked hidden states -> answers per request: the head queued on the device, its output
copied to the host without waiting (`start_answers`; `launch_rows` puts the head in the row pass's
CUDA graph when it can), the answers built when they are read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from kev.exec.transfer import host_int64, to_device, to_host_later
from kev.exec.batch import RowBatch
from kev.exec.passes import Passes
from kev.request.head import DecisionHead, answers, pick_layout, segments
from kev.request.prompts import PreparedRequest


def answer_rows(head: DecisionHead, prepared: Sequence[PreparedRequest], hidden: torch.Tensor) -> list[dict]:
    """Answers per request from the row pass's picked hidden states ([decide, opt ends...] per row)."""
    return start_answers(head, prepared, hidden).result()


@dataclass(eq=False)
class PendingAnswers:
    """A pass's head output on its way to the host. `result()` waits for it (on CUDA, for the work
    queued before it only: a later pass may already run) and builds the answers per request."""

    prepared: Sequence[PreparedRequest]
    questions: list
    counts: list[int]
    probs: torch.Tensor  # [O] fp32 on the host (pinned, filled by a copy behind `ready` on CUDA)
    ready: torch.cuda.Event | None
    options: list[int] | None = None  # when `probs` holds every pick ([P]): the options' picks

    def wait(self) -> None:
        """Until the probabilities are on the host (no-op on CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    def result(self) -> list[dict]:
        self.wait()
        probs = self.probs
        if self.options is not None:
            every = probs.tolist()
            probs = [every[i] for i in self.options]
        return _per_request(self.prepared, answers(self.questions, probs, self.counts))


def request_answers(prepared: PreparedRequest, probs: Sequence[float]) -> dict:
    """One request's answers (row name -> answer) from its rows' option probabilities, rows in
    order, one after another (`option_probabilities`; a bank's sweep sends them: bank_service)."""
    questions, counts = _layout([prepared])
    if len(probs) != sum(counts):
        raise ValueError(f"{len(probs)} probabilities for {sum(counts)} options")
    return _per_request([prepared], answers(questions, probs, counts))[0]


def _per_request(prepared: Sequence[PreparedRequest], flat: list) -> list[dict]:
    out, k = [], 0
    for req in prepared:
        out.append({row.name: flat[k + j] for j, row in enumerate(req.rows)})
        k += len(req.rows)
    return out


def _layout(prepared: Sequence[PreparedRequest]) -> tuple[list, list[int]]:
    """(questions, option counts) of a pass's rows, in row order."""
    questions = [row.question for req in prepared for row in req.rows]
    return questions, [len(row.prompt.option_end_indices) for req in prepared for row in req.rows]


def _pick_indices(option_counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """(decide picks, option picks) of rows whose picks are [decide, option ends...] each, in row
    order (kev.request.rows)."""
    decide_idx, opt_idx = [], []
    i = 0
    for n in option_counts:
        decide_idx.append(i)
        opt_idx.extend(range(i + 1, i + 1 + n))
        i += 1 + n
    return decide_idx, opt_idx


def launch_rows(passes: Passes, head: DecisionHead, prepared: Sequence[PreparedRequest], batch: RowBatch
                ) -> PendingAnswers:
    """A pass's rows and their head queued on the device, the answers on their way to the host:
    the decision head inside the row pass's CUDA graph when it has one (`Passes.row_probabilities`:
    one replay and one copy out), else the row pass then `start_answers`."""
    questions, counts = _layout(prepared)
    probs = passes.row_probabilities(batch, pick_layout(counts), max(counts, default=0))
    if probs is None:
        return start_answers(head, prepared, passes.row_pass(batch))
    return PendingAnswers(prepared, questions, counts, *_to_host(probs), options=_pick_indices(counts)[1])


def _to_host(probs: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    host = to_host_later(probs)
    ready = None
    if probs.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # after the copy: waiting on it waits for this pass only
    return host, ready


def start_answers(head: DecisionHead, prepared: Sequence[PreparedRequest], hidden: torch.Tensor) -> PendingAnswers:
    """`answer_rows` in two steps: the head is queued on the device here and its output copied to
    the host without waiting, so the scorer can launch its next pass before it reads this one."""
    questions, counts = _layout(prepared)
    return PendingAnswers(prepared, questions, counts, *_to_host(option_probabilities(head, hidden, counts)))


def option_probabilities(head: DecisionHead, hidden: torch.Tensor, option_counts: Sequence[int]) -> torch.Tensor:
    """[O] fp32 on `hidden`'s device: each option's probability within its row's question, for rows
    whose picked states are [decide, option ends...] each, in row order (`hidden`: [P, d])."""
    decide_idx, opt_idx = _pick_indices(option_counts)
    # Every index the head needs in one host block and one copy (each torch op on the host may wait
    # for the GIL on the scorer's row worker: kev/exec/static_pass.py).
    seg, col = segments(option_counts)
    Q, O = len(decide_idx), len(opt_idx)
    block = to_device(host_int64(chain(decide_idx, opt_idx, seg, col)), hidden.device)
    at_decide, at_opts, seg_t, col_t = block.split([Q, O, O, O])
    return head.probabilities_at(hidden[at_decide], hidden[at_opts], seg_t, col_t, max(option_counts, default=0))
