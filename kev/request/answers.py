"""A pass's picked hidden states -> answers per request: the head queued on the device, its output
copied to the host without waiting (`start_answers`), the answers built when they are read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from kev.exec.transfer import host_int64, to_device, to_host_later
from kev.request.head import DecisionHead, answers, segments
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

    def wait(self) -> None:
        """Until the probabilities are on the host (no-op on CPU)."""
        if self.ready is not None:
            self.ready.synchronize()

    def result(self) -> list[dict]:
        self.wait()
        flat = answers(self.questions, self.probs, self.counts)
        out, k = [], 0
        for req in self.prepared:
            out.append({row.name: flat[k + j] for j, row in enumerate(req.rows)})
            k += len(req.rows)
        return out


def start_answers(head: DecisionHead, prepared: Sequence[PreparedRequest], hidden: torch.Tensor) -> PendingAnswers:
    """`answer_rows` in two steps: the head is queued on the device here and its output copied to
    the host without waiting, so the scorer can launch its next pass before it reads this one."""
    questions, counts, decide_idx, opt_idx = [], [], [], []
    i = 0
    for req in prepared:
        for row in req.rows:
            n = len(row.prompt.option_end_indices)
            questions.append(row.question)
            counts.append(n)
            decide_idx.append(i)
            opt_idx.extend(range(i + 1, i + 1 + n))
            i += 1 + n
    # Every index the head needs in one host block and one copy (each torch op on the host may wait
    # for the GIL on the scorer's row worker: kev/exec/static_pass.py).
    seg, col = segments(counts)
    Q, O = len(decide_idx), len(opt_idx)
    block = to_device(host_int64(chain(decide_idx, opt_idx, seg, col)), hidden.device)
    at_decide, at_opts, seg_t, col_t = block.split([Q, O, O, O])
    probs = head.probabilities_at(hidden[at_decide], hidden[at_opts], seg_t, col_t, max(counts, default=0))
    host = to_host_later(probs)
    ready = None
    if hidden.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # after the copy: waiting on it waits for this pass only
    return PendingAnswers(prepared, questions, counts, host, ready)
