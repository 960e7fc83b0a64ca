"""`SweepTrainOps`: documents and their question rows in one differentiable pass (training only).

Serving reads a document once (state pass: its final states go to a bank slot) and runs each
question as a row continuing the stored state (row pass). Training wants the same computation
with gradients flowing from every row back into its document, and one document shared by
several rows, so each document is read once per step. Here a single pass holds both:

    document sequences: read slot -1, write slot j (a slot id only names the document)
    row sequences:      read slot j,  write slot -1, prefix length = the document's length

and, per layer, each op computes the documents first, keeps their final states *in the autograd
graph* (never in the pools), then continues every row from its document's state: the conv's
last W-1 inputs, the DeltaNet state, the attention keys and values. This is the per-layer
"document, then its rows" sweep of docs/design.md section 4, with gradients. Rows read exactly what the
bank would hold, so the outputs equal a state pass + row pass through `TorchOps`
(tests/demo/test_demo_model.py checks the picked hidden states).

The maths is the torch reference: `chunk_gated_delta_rule` of `kev.ops.delta_rule.chunk_torch`
(autograd-friendly), the same depthwise conv + silu, softmax attention with fp32 scores, and the
norms/activations inherited from `TorchOps`. Instead of `TorchOps`' loop over sequences (on a CPU,
per-sequence overhead rather than arithmetic sets the speed of a tiny model), sequences are
zero-padded to [N, L_max] and each op runs once per pass; the sequences are folded into the delta
rule's head dimension. Padding follows each sequence's last token, so causality keeps it out of
real outputs, and zero k/v/g/beta leave the DeltaNet state unchanged (the final state is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kev.ops.utils import channel_blocks
from kev.ops.delta_rule.chunk_torch import chunk_gated_delta_rule
from kev.ops.fused.reference import gated_output
from kev.ops.gates import DeltaGates
from kev.ops.meta import PassMeta
from kev.ops.torch_ops import TorchOps, l2_normalize


@dataclass(frozen=True, eq=False)
class _Group:
    """One kind of sequence (documents or rows) in a zero-padded layout."""

    tok: torch.Tensor  # [Tg] packed token indices of the group's tokens
    seq: torch.Tensor  # [Tg] sequence index within the group
    pos: torch.Tensor  # [Tg] position within the sequence
    n: int
    length: int  # L_max

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] packed (whole pass) -> [n, L_max, ...] zero padded, differentiable."""
        return x.new_zeros((self.n, self.length, *x.shape[1:])).index_put((self.seq, self.pos), x[self.tok])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[n, L_max, ...] -> [Tg, ...] in the group's token order."""
        return x[self.seq, self.pos]


@dataclass(frozen=True, eq=False)
class _Layout:
    docs: _Group
    rows: _Group
    doc_lens: torch.Tensor  # [Nd]
    row_doc: torch.Tensor  # [Nr] document index of each row
    order: torch.Tensor  # [T]: packed index -> index into cat(doc tokens, row tokens)

    def merge(self, doc_out: torch.Tensor, row_out: torch.Tensor) -> torch.Tensor:
        return torch.cat([doc_out, row_out])[self.order]


def _group(spans: list[tuple[int, int]], device) -> _Group:
    tok = [t for s, e in spans for t in range(s, e)]
    seq = [i for i, (s, e) in enumerate(spans) for _ in range(s, e)]
    pos = [t - s for s, e in spans for t in range(s, e)]
    as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    return _Group(as_long(tok), as_long(seq), as_long(pos), len(spans), max((e - s for s, e in spans), default=0))


def _layout(meta: PassMeta, device) -> _Layout:
    host = meta.host
    doc_spans, row_spans, doc_of_slot, row_doc = [], [], {}, []
    for n, s, e, read, write, prefix in host.seqs():
        if read < 0 and prefix == 0:
            if write >= 0:
                doc_of_slot[write] = len(doc_spans)
            doc_spans.append((s, e))
    for n, s, e, read, write, prefix in host.seqs():
        if read < 0 and prefix == 0:
            continue
        if write >= 0 or read not in doc_of_slot:
            raise ValueError(f"sequence {n}: a row must read the slot a document of the same pass writes "
                             f"(read {read}, write {write}); SweepTrainOps never touches the bank")
        d = doc_of_slot[read]
        doc_len = doc_spans[d][1] - doc_spans[d][0]
        if prefix != doc_len:
            raise ValueError(f"sequence {n}: prefix {prefix} != its document's length {doc_len}")
        row_spans.append((s, e))
        row_doc.append(d)
    if not row_spans:
        raise ValueError("SweepTrainOps needs question rows after their documents")
    docs, rows = _group(doc_spans, device), _group(row_spans, device)
    order = torch.empty(host.cu_seqlens[-1], dtype=torch.int64, device=device)
    order[torch.cat([docs.tok, rows.tok])] = torch.arange(order.shape[0], device=device)
    doc_lens = torch.tensor([e - s for s, e in doc_spans], dtype=torch.int64, device=device)
    return _Layout(docs, rows, doc_lens, torch.tensor(row_doc, dtype=torch.int64, device=device), order)


class SweepTrainOps(TorchOps):
    name = "torch-sweep-train"

    def __init__(self, record_attention: bool = False) -> None:
        self._last: tuple[PassMeta, _Layout] | None = None  # every op of a pass shares one layout
        # When set, each attention layer appends its rows' probabilities [Nr, Hq, Lr, Ld + Lr]
        # (columns: the document's padded keys, then the row's own) for an auxiliary loss.
        self.record_attention = record_attention
        self.row_attention: list[torch.Tensor] = []

    def _layout(self, meta: PassMeta, device) -> _Layout:
        if self._last is None or self._last[0] is not meta:
            self._last = (meta, _layout(meta, device))
        return self._last[1]

    def causal_conv(self, x, weight, meta: PassMeta, conv_pool, split=None, out=None):
        lay = self._layout(meta, x.device)
        W, C = weight.shape[1], x.shape[1]
        w = weight[:, None, :].to(x.dtype)
        xd = F.pad(lay.docs.pad(x).transpose(1, 2), (W - 1, 0))  # [Nd, C, W-1+Ld]: zero start state
        yd = F.silu(F.conv1d(xd, w, groups=C)).transpose(1, 2)  # [Nd, Ld, C]
        # A document's last W-1 inputs: columns len .. len+W-2 of the left-padded [C, W-1+L] buffer.
        cols = lay.doc_lens[:, None] + torch.arange(W - 1, device=x.device)  # [Nd, W-1]
        start = xd.gather(2, cols[:, None, :].expand(-1, C, -1))  # [Nd, C, W-1]
        xr = torch.cat([start[lay.row_doc], lay.rows.pad(x).transpose(1, 2)], dim=2)  # [Nr, C, W-1+Lr]
        yr = F.silu(F.conv1d(xr, w, groups=C)).transpose(1, 2)  # [Nr, Lr, C]
        return channel_blocks(lay.merge(lay.docs.unpad(yd), lay.rows.unpad(yr)), split, out)

    def gated_delta_rule(self, q, k, v, gates: DeltaGates, meta: PassMeta, state_pool):
        lay = self._layout(meta, v.device)
        g, beta = gates.values()
        HV, K, V = v.shape[1], q.shape[2], v.shape[2]
        group = HV // q.shape[1]
        q = l2_normalize(q.float()).repeat_interleave(group, dim=1) * K**-0.5
        k = l2_normalize(k.float()).repeat_interleave(group, dim=1)
        v, beta = v.float(), beta.float()

        def heads(grp: _Group, t: torch.Tensor) -> torch.Tensor:  # [T, HV, *] -> [L, N*HV, *]
            p = grp.pad(t)  # [N, L, HV, *]
            return p.transpose(0, 1).reshape(grp.length, grp.n * HV, *t.shape[2:])

        def run(grp: _Group, start: torch.Tensor):
            o, final = chunk_gated_delta_rule(heads(grp, q), heads(grp, k), heads(grp, v), heads(grp, g),
                                              heads(grp, beta), start)
            o = o.reshape(grp.length, grp.n, HV, V).transpose(0, 1)  # [N, L, HV, V]
            return grp.unpad(o), final.reshape(grp.n, HV, K, V)

        zeros = torch.zeros(lay.docs.n * HV, K, V, dtype=torch.float32, device=v.device)
        od, states = run(lay.docs, zeros)  # states [Nd, HV, K, V] stay in the graph
        orow, _ = run(lay.rows, states[lay.row_doc].reshape(lay.rows.n * HV, K, V))
        return lay.merge(od, orow).to(v.dtype)

    def attention(self, q, k, v, meta: PassMeta, key_pages, value_pages, gate=None, out=None):
        lay = self._layout(meta, q.device)
        Hq, D = q.shape[1], q.shape[2]
        group = Hq // k.shape[1]
        dev = q.device

        def attend(qp, kp, vp, mask, record=False):  # [N, Lq, Hq, D], [N, Lk, Hkv, D] x2, [N or 1, Lq, Lk]
            kp = kp.repeat_interleave(group, dim=2).transpose(1, 2)  # [N, Hq, Lk, D]
            vp = vp.repeat_interleave(group, dim=2).transpose(1, 2)
            scores = (qp.transpose(1, 2) @ kp.transpose(2, 3)).float() * D**-0.5  # [N, Hq, Lq, Lk]
            probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1).to(q.dtype)
            if record:
                self.row_attention.append(probs)
            return (probs @ vp).transpose(1, 2)  # [N, Lq, Hq, D]

        Ld, Lr = lay.docs.length, lay.rows.length
        kd, vd = lay.docs.pad(k), lay.docs.pad(v)  # [Nd, Ld, Hkv, D]: what the bank pages would hold
        causal_d = torch.ones(Ld, Ld, dtype=torch.bool, device=dev).tril()[None]
        od = attend(lay.docs.pad(q), kd, vd, causal_d)
        # A row sees its document's first `len` keys, then its own keys causally.
        prefix = torch.arange(Ld, device=dev)[None, :] < lay.doc_lens[lay.row_doc][:, None]  # [Nr, Ld]
        own = torch.ones(Lr, Lr, dtype=torch.bool, device=dev).tril()
        mask = torch.cat([prefix[:, None, :].expand(-1, Lr, -1), own[None].expand(lay.rows.n, -1, -1)], dim=2)
        keys = torch.cat([kd[lay.row_doc], lay.rows.pad(k)], dim=1)  # [Nr, Ld+Lr, Hkv, D]
        values = torch.cat([vd[lay.row_doc], lay.rows.pad(v)], dim=1)
        orow = attend(lay.rows.pad(q), keys, values, mask, record=self.record_attention)
        return gated_output(lay.merge(lay.docs.unpad(od), lay.rows.unpad(orow)), gate, out)
