"""The one definition of a document's key: the directory key, the bank's dedup key and the
load balancer's affinity key are all this string, so a repeat of a document lands where its state is."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

AFFINITY_HEADER = "x-kev-doc-key"


def key_fingerprint(doc_key: str) -> int:
    """A non-zero int64 of the key (first 8 bytes of its sha256), stored beside a slot's generation in
    the shared bank so a reader can confirm which document a slot holds (kev/bank/shared.py)."""
    value = int.from_bytes(hashlib.sha256(doc_key.encode()).digest()[:8], "little", signed=True)
    return value or 1


def document_key(model_id: str, token_ids: Sequence[int]) -> str:
    """`<model_id>:<sha256 of the little-endian int32 token ids>`; stable across processes and hosts."""
    digest = hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()
    return f"{model_id}:{digest}"
