"""In-process scoring: `Engine.score(request) -> response`, the whole product in one object.

The flow every deployment shares, in one place:
    prepare (validate + render)  ->  document handles (bank hit, or a new slot)
    ->  one sweep: new documents' state pass and every question row  ->  head  ->  answers
The scorer service runs the same steps with the bank in another process, with the same pieces
(`kev.loading.LoadedModel`, `kev.request.rows.row_batch_for`, `kev.request.answers`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from kev.bank.bank import Bank, BankFull, BankHandle
from kev.bank.doc_key import document_key
from kev.exec.plan import GraphPlan, PassRole
from kev.exec.passes import PassBuilder
from kev.exec.batch import RowBatch
from kev.loading import LoadedModel
from kev.ops import Ops, get_ops
from kev.request.answers import answer_rows
from kev.request.api import ScoreRequest, ScoreResponse, Usage
from kev.request.prompts import validate_and_build
from kev.request.rows import row_batch_for


class Engine:
    """A model, its own bank and an LRU of document states, scoring requests in process.
    With TritonOps on CUDA the passes are class-tuned and graphed as in the services
    (kev.exec.passes; built here, so construction warms up and captures `plan`'s buckets)."""

    def __init__(self, loaded: LoadedModel, bank: Bank, ops: Ops | None = None, plan: GraphPlan = GraphPlan()):
        self.loaded = loaded
        self.bank = bank
        self.passes = PassBuilder(loaded.model, ops or get_ops("torch"), PassRole.BOTH, plan).build(bank)
        self._documents: OrderedDict[str, BankHandle] = OrderedDict()  # doc key -> handle, LRU first

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, adapter_dir=None, device: str = "cpu",
                        bank_bytes: int = 256 << 20, ops: Ops | None = None) -> "Engine":
        loaded = LoadedModel.load(checkpoint_dir, adapter_dir, device=device)
        dtype = next(loaded.model.parameters()).dtype
        bank = Bank.from_budget(loaded.model.cfg, bank_bytes, dtype=dtype, device=device,
                                max_doc_tokens=loaded.builder.limits.max_document_tokens)
        return cls(loaded, bank, ops)

    def clear(self) -> None:
        """Forget every stored document (their slots go back to the bank)."""
        while self._documents:
            self.bank.free(self._documents.popitem()[1])

    def score(self, request: ScoreRequest) -> ScoreResponse:
        (response,) = self.score_many([request])
        if isinstance(response, Exception):
            raise response
        return response

    def score_many(self, requests: Sequence[ScoreRequest]) -> list[ScoreResponse | Exception]:
        """Scores requests together (new documents and every row in one sweep over the weights,
        `sweep`); a bad request gets its own exception in its place and does not
        affect the others."""
        start = time.perf_counter()
        results: list[ScoreResponse | Exception | None] = [None] * len(requests)
        prepared, where = [], []
        for i, req in enumerate(requests):
            try:
                prepared.append(validate_and_build(req, self.loaded.builder))
                where.append(i)
            except Exception as err:  # noqa: BLE001 - returned to its caller, not swallowed
                results[i] = err
        if prepared:
            handles, cached, new = self._document_handles([p.document_ids for p in prepared])
            batch = row_batch_for(prepared, handles, self.bank.block_table.device)
            if new:
                hidden = self._store_new(new, batch)
            else:
                hidden = self.passes.row_pass(batch)
            per_request = answer_rows(self.loaded.head, prepared, hidden)
            ms = (time.perf_counter() - start) * 1000
            for i, p, ans, hit in zip(where, prepared, per_request, cached):
                doc = len(p.document_ids)
                usage = Usage(input_tokens=p.input_tokens, cached_state_tokens=doc if hit else 0,
                              document_tokens=doc, truncated=p.truncated, unknown_tokens=p.unknown_tokens)
                results[i] = ScoreResponse(answers=ans, usage=usage, model_ms=ms, model=self.loaded.model_id)
        return results

    def _store_new(self, new: dict[str, tuple[Sequence[int], BankHandle]], batch: RowBatch) -> torch.Tensor:
        """One sweep: the new documents into their slots, and the rows; the documents are kept only
        if the pass ran (a failed pass gives their slots back)."""
        docs, handles = [d for d, _ in new.values()], [h for _, h in new.values()]
        try:
            hidden = self.passes.sweep(docs, handles, batch)
        except BaseException:
            for h in handles:
                self.bank.free(h)
            raise
        for key, (_, h) in new.items():
            self._documents[key] = h
        return hidden

    def _document_handles(self, documents: Sequence[Sequence[int]]
                          ) -> tuple[list[BankHandle], list[bool], dict[str, tuple[Sequence[int], BankHandle]]]:
        """A handle per document and whether it was stored; new documents (key -> (tokens, handle))
        get a slot here and their states in the sweep (`_store_new`)."""
        keys = [document_key(self.loaded.model_id, d) for d in documents]
        handles: dict[str, BankHandle] = {}
        hits, new = [], {}
        for key, doc in zip(keys, documents):
            if key in self._documents:
                self._documents.move_to_end(key)
                handles[key] = self._documents[key]
                hits.append(True)
            elif key in handles:  # a repeat inside this batch: state-passed once
                hits.append(False)
            else:
                try:
                    handles[key] = self._alloc(len(doc), protect=set(keys))
                except BaseException:
                    for _, h in new.values():
                        self.bank.free(h)
                    raise
                new[key] = (doc, handles[key])
                hits.append(False)
        return [handles[k] for k in keys], hits, new

    def _alloc(self, tokens: int, protect: set[str]) -> BankHandle:
        while True:
            try:
                return self.bank.alloc(tokens)
            except BankFull:
                victim = next((k for k in self._documents if k not in protect), None)
                if victim is None:
                    raise
                self.bank.free(self._documents.pop(victim))
