"""Prepared requests -> one `RowBatch`: every question row, each continuing its request's document."""

from __future__ import annotations

from collections.abc import Sequence

from kev.bank.bank import BankHandle
from kev.exec.batch import RowBatch
from kev.request.prompts import PreparedRequest, QuestionRow


def row_picks(row: QuestionRow) -> list[int]:
    """Where the decision head reads a row: its `<decide>` token, then each option's last token."""
    return [row.prompt.decide_index, *row.prompt.option_end_indices]


def row_batch_for(prepared: Sequence[PreparedRequest], handles: Sequence[BankHandle], device) -> RowBatch:
    """Every question row of every request, each continuing its request's document."""
    rows, row_handles, lens, picks = [], [], [], []
    for req, handle in zip(prepared, handles, strict=True):
        for row in req.rows:
            rows.append(row.prompt.ids)
            row_handles.append(handle)
            lens.append(len(req.document_ids))
            picks.append(row_picks(row))
    return RowBatch.build(rows, row_handles, lens, picks, device=device)
