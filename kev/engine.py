"""In-process scoring: `Engine.score(request) -> response`, the whole product in one object.

The flow every deployment shares, in one place:
    prepare (validate + render)  ->  document handles (bank hit, or a new slot)
    ->  one sweep: new documents' state pass and every question row  ->  head  ->  answers
The scorer service runs the same steps with the bank in another process; `answer_rows` and
`row_batch_for` are what both use.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kev.request.api import ScoreRequest, ScoreResponse, Usage
from kev.bank.bank import Bank, BankFull, BankHandle
from kev.model.checkpoint import load_checkpoint
from kev.bank.doc_key import document_key
from kev.request.head import DecisionHead, answers, load_head
from kev.model.qwen35 import Qwen35Model
from kev.ops import Ops, get_ops
from kev.exec.passes import GraphPlan, PassBuilder, PassRole
from kev.request.prompts import Delimiters, Limits, PreparedRequest, PromptBuilder, validate_and_build
from kev.exec.runner import RowBatch
from kev.exec.transfer import to_device, to_host_later


@dataclass(frozen=True)
class LoadedModel:
    """Everything read from a checkpoint directory, ready to run."""

    model_id: str
    model: Qwen35Model
    head: DecisionHead
    builder: PromptBuilder

    @classmethod
    def load(cls, checkpoint_dir: str | Path, adapter_dir: str | Path | None = None, device: str = "cpu",
             dtype: torch.dtype | None = None, limits: Limits = Limits()) -> "LoadedModel":
        dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
        ckpt = load_checkpoint(checkpoint_dir, adapter_dir, dtype=dtype, device=device,
                               require_head=True, require_tokenizer=True)
        with torch.device("meta"):  # no random init to throw away: ~20-80 s of CPU for Kev-4B
            model = Qwen35Model(ckpt.config)
        model.load_state_dict(ckpt.weights, strict=True, assign=True)  # every parameter is a loaded tensor
        model = model.to(device).eval()
        if device == "cpu":
            model.set_batch_invariant()  # CPU promise: answers bit-identical whatever shares a pass
        else:
            model.fuse_projections()  # GPU: one GEMM per layer's input projections
        delimiters = Delimiters(**ckpt.meta.delimiters) if ckpt.meta.delimiters else Delimiters()
        builder = PromptBuilder(Tokenizer.from_file(str(ckpt.tokenizer_path)), delimiters, limits)
        head = load_head(ckpt.head_path, ckpt.config.hidden_size, device=device)
        return cls(ckpt.meta.model_id, model, head, builder)


def row_batch_for(prepared: Sequence[PreparedRequest], handles: Sequence[BankHandle], device) -> RowBatch:
    """Every question row of every request, each continuing its request's document."""
    rows, row_handles, lens, picks = [], [], [], []
    for req, handle in zip(prepared, handles, strict=True):
        for row in req.rows:
            rows.append(row.prompt.ids)
            row_handles.append(handle)
            lens.append(len(req.document_ids))
            picks.append([row.prompt.decide_index, *row.prompt.option_end_indices])
    return RowBatch.build(rows, row_handles, lens, picks, device=device)


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
    index = to_device(torch.tensor(decide_idx + opt_idx, dtype=torch.int64), hidden.device)
    probs = head.probabilities(hidden[index[: len(decide_idx)]], hidden[index[len(decide_idx) :]], counts)
    host = to_host_later(probs)
    ready = None
    if hidden.device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # after the copy: waiting on it waits for this pass only
    return PendingAnswers(prepared, questions, counts, host, ready)


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
        `state_and_row_pass`); a bad request gets its own exception in its place and does not
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
                              document_tokens=doc, truncated=p.truncated)
                results[i] = ScoreResponse(answers=ans, usage=usage, model_ms=ms, model=self.loaded.model_id)
        return results

    def _store_new(self, new: dict[str, tuple[Sequence[int], BankHandle]], batch: RowBatch) -> torch.Tensor:
        """One sweep: the new documents into their slots, and the rows; the documents are kept only
        if the pass ran (a failed pass gives their slots back)."""
        docs, handles = [d for d, _ in new.values()], [h for _, h in new.values()]
        try:
            hidden = self.passes.state_and_row_pass(docs, handles, batch)
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
