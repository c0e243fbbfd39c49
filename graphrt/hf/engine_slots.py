"""The engine's request rows and KV slots, kept on the host.

Which slots are free, which slots each request row holds and where a step's new tokens go are host
bookkeeping: assigning slots to a step and releasing a finished request touch no device memory (a
released row's table row is reset with one device fill). The request table on the device
(``req_to_token``) is written from the step's staged arena: ``table_index`` (each new token's flat
``row * max_context + position``) beside ``out_cache_loc``, one ``index_copy_`` per step.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from graphrt.reference import DUMMY_REQUEST, SCRATCH_SLOT, ReqToTokenPool


class SlotTable:
    """The free KV slots (a stack, never the scratch slot), the free request rows (``ReqToTokenPool``'s own
    host list, never the dummy row) and a host copy of the slots each row holds."""

    def __init__(self, table: ReqToTokenPool, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots: expected >= 2 (slot {SCRATCH_SLOT} is reserved), got {num_slots}")
        self.table = table
        self.num_slots = num_slots
        self.width = table.max_context_len
        self._free = np.arange(num_slots - 1, 0, -1, dtype=np.int64)  # taken from the end: 1, 2, 3, ...
        self._top = num_slots - 1
        self._held = np.zeros((table.num_requests, self.width), dtype=np.int64)

    @property
    def available(self) -> int:
        """KV slots that can still be assigned."""
        return self._top

    @property
    def free_rows(self) -> int:
        """Request rows that can still be taken."""
        return self.table.available

    def take_row(self) -> int:
        """A free request row."""
        return self.table.alloc()

    def assign(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
        """``counts[i]`` slots for positions ``starts[i]..`` of request row ``rows[i]``, held by the row at once:
        the slots in request order and each one's flat index in the request table (``row * width + position``)."""
        counts_array = np.asarray(counts, dtype=np.int64)
        starts_array = np.asarray(starts, dtype=np.int64)
        if (starts_array + counts_array).max(initial=0) > self.width:
            row = int(np.argmax(starts_array + counts_array > self.width))
            raise ValueError(f"counts: request row {rows[row]} would reach {starts[row] + counts[row]} tokens, "
                             f"max_context_len is {self.width}")
        if DUMMY_REQUEST in rows:
            raise ValueError(f"rows: request row {DUMMY_REQUEST} is the reserved dummy request")
        total = int(counts_array.sum())
        if total > self._top:
            raise RuntimeError(f"KV slots: asked for {total}, only {self._top} free")
        slots = self._free[self._top - total: self._top][::-1].copy()
        self._top -= total
        ends = np.cumsum(counts_array)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts_array - (ends - counts_array), counts_array)
        index = np.repeat(np.asarray(rows, dtype=np.int64), counts_array) * self.width + positions
        self._held.reshape(-1)[index] = slots
        return slots, index

    def release(self, row: int, count: int) -> None:
        """Request row ``row`` and the slots of its first ``count`` positions back (its device table row reset)."""
        freed = self._held[row, :count]
        self._free[self._top: self._top + count] = freed[::-1]
        self._top += count
        self.table.free(row)


__all__ = ["SlotTable"]
