"""Backbone parity with transformers' Qwen3.5 text model (its torch fallbacks) on tiny random checkpoints."""

import pytest
import torch

from kev.model.checkpoint import load_checkpoint
from kev.model.qwen35 import Qwen35Model
from kev.ops import PassMeta, get_ops
from kev.bank.bank import Bank
from tiny_checkpoints import hide_fla, make_hf_checkpoint


def our_forward(model, ids):
    T = ids.shape[0]
    bank = Bank.allocate(model.cfg, 1, -(-T // 16), block_size=16)
    meta = PassMeta(cu_seqlens=torch.tensor([0, T]), read_slots=torch.tensor([-1]), write_slots=torch.tensor([0]),
                    prefix_lens=torch.tensor([0]), block_table=bank.block_table[:1])
    with torch.no_grad():
        return model(ids, meta, bank.pools, get_ops("torch"))


# HV/H changes the delta rule's head grouping; tied/nested change only loading: one case per class.
CASES = [
    dict(hv_per_h=1, tied=True, nested=False),
    dict(hv_per_h=2, tied=False, nested=True),
    dict(hv_per_h=3, tied=True, nested=True, shards=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_hidden_states_match_transformers(tmp_path, case):
    path, hf = make_hf_checkpoint(tmp_path / "ckpt", seed=3, **case)
    ckpt = load_checkpoint(path)
    model = Qwen35Model(ckpt.config)
    model.load_state_dict(ckpt.weights, strict=True)
    model.eval().set_batch_invariant()
    ids = torch.randint(0, ckpt.config.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    with hide_fla() as calls, torch.no_grad():
        ref = hf.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    assert calls["torch_chunk_gated_delta_rule"], "transformers did not run its torch reference"
    out = our_forward(model, ids)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= 1e-4, rel
