"""The one definition of a document's key: the directory key, the bank's dedup key and the
load balancer's affinity key are all this string, so a repeat of a document lands where its state is."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

AFFINITY_HEADER = "x-kev-doc-key"


def document_key(model_id: str, token_ids: Sequence[int]) -> str:
    """`<model_id>:<sha256 of the little-endian int32 token ids>`; stable across processes and hosts."""
    digest = hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()
    return f"{model_id}:{digest}"
