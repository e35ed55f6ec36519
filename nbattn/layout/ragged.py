"""Ragged queries: requests packed back to back (docs/concepts/layouts.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .checks import LayoutError, check_indptr

__all__ = ["IndptrRows", "RaggedQ"]


class IndptrRows:
    """What a CSR row pointer tells about its requests, for the dataclasses that hold
    one (their class attribute ``indptr_field`` names the field)."""
    indptr_field = ""

    @property
    def batch_size(self) -> int:
        return len(getattr(self, self.indptr_field)) - 1

    def counts(self) -> np.ndarray:
        """Entries per request (``np.diff`` of the row pointer), int32."""
        return np.diff(getattr(self, self.indptr_field)).astype(np.int32)


@dataclass(frozen=True)
class RaggedQ(IndptrRows):
    """Requests packed back to back: rows of request r are
    ``qo_indptr[r]:qo_indptr[r+1]``."""
    qo_indptr: np.ndarray
    indptr_field = "qo_indptr"

    @classmethod
    def from_lengths(cls, qo_lens: Sequence[int]) -> "RaggedQ":
        lens = np.asarray(qo_lens, dtype=np.int64)
        if lens.size and lens.min() < 0:
            raise LayoutError("qo_lens: must be >= 0")
        return cls(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))

    @classmethod
    def validate(cls, qo_indptr: Any, *, total_rows: int | None = None,
                 name: str = "qo_indptr") -> "RaggedQ":
        return cls(check_indptr(name, qo_indptr, total=total_rows, total_name="the number of query rows"))

    @property
    def lengths(self) -> np.ndarray:
        return self.counts()

    @property
    def total(self) -> int:
        return int(self.qo_indptr[-1])
