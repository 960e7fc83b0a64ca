"""The bank layout: the one place that says how stored document states sit in memory.

Per DeltaNet layer
    recurrent[l]: [slots, HV, K, V] fp32   (K-major, as fla's initial/final states; one slot per document)
    conv[l]:      [slots, conv_dim, W-1]   model dtype: the last W-1 inputs of the short convolution
Per attention layer (paged, so a 60k-token document and a 40-token one share one pool)
    keys[l], values[l]: [blocks, block_size, Hkv, head_dim] model dtype, keys stored after norm+RoPE
A slot's K/V pages are listed in its block table (`Bank.block_table[slot]`), shared by all
attention layers: page p of a slot is page p in every layer's pool.

The pools may be views into a larger buffer (shared memory, CUDA IPC); ops read and write them
in place by index and never reshape or copy them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kev.model.config import ModelConfig


@dataclass(frozen=True, eq=False)
class StatePools:
    recurrent: tuple[torch.Tensor, ...]
    conv: tuple[torch.Tensor, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.recurrent[0].shape[0] if self.recurrent else self.conv[0].shape[0]

    @property
    def num_blocks(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    def tensors(self) -> list[torch.Tensor]:
        return [*self.recurrent, *self.conv, *self.keys, *self.values]

    @staticmethod
    def shapes(cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int) -> dict[str, tuple[int, ...]]:
        hv, k, v = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return {
            "recurrent": (num_slots, hv, k, v),
            "conv": (num_slots, cfg.conv_dim, cfg.conv_kernel - 1),
            "kv": (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim),
        }

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> "StatePools":
        s = cls.shapes(cfg, num_slots, num_blocks, block_size)
        n_delta, n_attn = len(cfg.deltanet_layers), len(cfg.attention_layers)
        return cls(
            recurrent=tuple(torch.zeros(s["recurrent"], dtype=torch.float32, device=device) for _ in range(n_delta)),
            conv=tuple(torch.zeros(s["conv"], dtype=dtype, device=device) for _ in range(n_delta)),
            keys=tuple(torch.zeros(s["kv"], dtype=dtype, device=device) for _ in range(n_attn)),
            values=tuple(torch.zeros(s["kv"], dtype=dtype, device=device) for _ in range(n_attn)),
            block_size=block_size,
        )

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Fixed per-document bytes (recurrent + conv), independent of document length."""
        n_delta = len(cfg.deltanet_layers)
        esize = torch.empty((), dtype=dtype).element_size()
        rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        conv = cfg.conv_dim * (cfg.conv_kernel - 1) * esize
        return n_delta * (rec + conv)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        esize = torch.empty((), dtype=dtype).element_size()
        return 2 * len(cfg.attention_layers) * block_size * cfg.num_key_value_heads * cfg.head_dim * esize
