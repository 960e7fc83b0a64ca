"""The model's weights in memory other processes map: one copy per GPU, owned by the bank and
mapped read-only by its scorers (issue 28), shared the way the bank's pools are (kev/bank/shared.py).

Owner (bank_service): `SharedWeights.create(model, device=..., instance=...)` moves every tensor of
the model's state dict into one segment (a /dev/shm file on CPU; one CUDA allocation shared by IPC
on GPU) storage by storage, so tensors that were views of one buffer (the fused input projections)
stay views of one region. The model is re-pointed at the segment (and re-fused there without a
copy) and its previous storage freed: the owner runs on the shared copy too. `descriptors()` gives
each tensor as a TensorDescriptor (`AttachResponse.weights`).

Mapper (a scorer): `map_weights(descriptors)` returns name -> view of the owner's memory, and
`kev.loading.LoadedModel.bind` builds a model on them. Nothing writes a parameter at inference, so
"read-only" is the contract, not a page protection (CUDA IPC has none).

Lifetime as for the pools: the owner unlinks its file at `close()` and a reaper does when the owner
dies; a mapper's views keep a CPU mapping valid until dropped; a new bank instance is a new segment,
and a scorer maps it on re-attach and drops the old one with the old attachment (on CUDA the old
memory is gone with its owner, so nothing may keep using it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import torch

from kev.bank.shared import (SEGMENT_PREFIX, _align, _CudaSegment, _Reaper, _ShmSegment, _typed_view, describe,
                             map_descriptors)
from kev.model.qwen35 import Qwen35Model
from kev.v1 import bank_pb2 as pb

log = logging.getLogger(__name__)

WEIGHTS_SUFFIX = "-weights"  # the CPU segment: /dev/shm/kev-bank-<instance>-weights


class SharedWeights:
    def __init__(self, tensors: dict[str, torch.Tensor], segment, reaper: _Reaper | None):
        self.tensors = tensors
        self._segment = segment
        self._reaper = reaper

    @property
    def nbytes(self) -> int:
        return self._segment.base.numel()

    @classmethod
    @torch.no_grad()
    def create(cls, model: Qwen35Model, *, device: str | torch.device, instance: str,
               shm_dir: str | Path = "/dev/shm") -> "SharedWeights":
        """Move `model`'s state into a new shared segment on `device` (from wherever it is now: the
        bank reads it into host memory first, so the device never holds two copies)."""
        device = torch.device(device)
        state = model.state_dict()
        fused = any(getattr(m, "fused", None) is not None for m in model.modules())
        regions: dict[int, int] = {}  # storage address -> byte offset of its region in the segment
        storages: list[torch.UntypedStorage] = []
        total = 0
        for t in state.values():
            st = t.untyped_storage()
            if st.data_ptr() not in regions:
                regions[st.data_ptr()] = total
                storages.append(st)
                total += _align(st.nbytes())
        if device.type == "cuda":
            segment, reaper = _CudaSegment.allocate(total, device), None
        else:
            segment = _ShmSegment(Path(shm_dir) / f"{SEGMENT_PREFIX}{instance}{WEIGHTS_SUFFIX}", total, create=True)
            reaper = _Reaper([segment.path])
        try:
            for st in storages:
                raw = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)  # the storage's bytes
                start = regions[st.data_ptr()]
                segment.base[start : start + st.nbytes()].copy_(raw)
            views = {}
            for name, t in state.items():
                esize = t.element_size()
                offset = regions[t.untyped_storage().data_ptr()] // esize + t.storage_offset()
                views[name] = _typed_view(segment.base, t.dtype, t.shape, t.stride(), offset)
        except BaseException:
            segment.close()
            if reaper is not None:
                reaper.close()
            raise
        del state, storages
        model.load_state_dict(views, strict=True, assign=True)  # the old storage goes with its last view
        if fused:
            model.fuse_projections()  # the fused buffers are regions of the segment: adopted, not copied
        log.info("model weights shared: %d tensors, %.2f GB on %s", len(views), total / 1e9, device)
        return cls(views, segment, reaper)

    def descriptors(self) -> list[pb.TensorDescriptor]:
        """Every tensor as a TensorDescriptor (a CUDA IPC handle is fresh per call)."""
        raw = self._segment.descriptor()
        return [describe(name, t, self._segment, raw) for name, t in self.tensors.items()]

    @property
    def segment_paths(self) -> list[Path]:
        return [self._segment.path] if isinstance(self._segment, _ShmSegment) else []

    def close(self) -> None:
        """Unlink the file (mappers' views stay valid) and drop this process's views."""
        self._segment.close()
        self.tensors = {}
        if self._reaper is not None:
            self._reaper.close()
            self._reaper = None


def map_weights(descriptors: Iterable[pb.TensorDescriptor]) -> dict[str, torch.Tensor]:
    """The owner's weights, name -> view of its memory. Raises ValueError on an unknown dtype or
    an inconsistent descriptor, OSError when the segment cannot be opened."""
    return map_descriptors(descriptors, "shared weight")[0]
