"""The engine's request rows and KV slots, kept on the host.

Which slots are free, which slots each request row holds and where a step's new tokens go are host
bookkeeping: assigning slots to a step and releasing a finished request touch no device memory (a
released row's table row is reset with one device fill). The request table on the device
(``req_to_token``) is written from the step's staged arena: ``table_index`` (each new token's flat
``row * max_context + position``) beside ``out_cache_loc``, one ``index_copy_`` per step.
"""

from __future__ import annotations

import operator
from typing import List, Sequence, Tuple

from graphrt.reference import DUMMY_REQUEST, SCRATCH_SLOT, ReqToTokenPool


class SlotTable:
    """The free KV slots (a stack, never the scratch slot), the free request rows (``ReqToTokenPool``'s own
    host list, never the dummy row) and the slots each row holds, as Python lists (a step assigns a few
    slots: list operations cost less than array calls there)."""

    def __init__(self, table: ReqToTokenPool, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots: expected >= 2 (slot {SCRATCH_SLOT} is reserved), got {num_slots}")
        self.table = table
        self.num_slots = num_slots
        self.width = table.max_context_len
        self._free = list(range(num_slots - 1, 0, -1))  # taken from the end: 1, 2, 3, ...
        self._held: List[List[int]] = [[] for _ in range(table.num_requests)]

    @property
    def available(self) -> int:
        """KV slots that can still be assigned."""
        return len(self._free)

    @property
    def free_rows(self) -> int:
        """Request rows that can still be taken."""
        return self.table.available

    def take_row(self) -> int:
        """A free request row."""
        return self.table.alloc()

    def assign(self, rows: Sequence[int], starts: Sequence[int], counts: Sequence[int]) -> Tuple[List[int], List[int]]:
        """``counts[i]`` slots for positions ``starts[i]..`` of request row ``rows[i]``, held by the row at once:
        the slots in request order and each one's flat index in the request table (``row * width + position``)."""
        width, free = self.width, self._free
        ends = list(map(operator.add, starts, counts))
        if max(ends, default=0) > width:
            row = next(index for index, end in enumerate(ends) if end > width)
            raise ValueError(f"counts: request row {rows[row]} would reach {ends[row]} tokens, "
                             f"max_context_len is {width}")
        if DUMMY_REQUEST in rows:
            raise ValueError(f"rows: request row {DUMMY_REQUEST} is the reserved dummy request")
        total = sum(counts)
        if total > len(free):
            raise RuntimeError(f"KV slots: asked for {total}, only {len(free)} free")
        slots = free[len(free) - total:]
        del free[len(free) - total:]
        slots.reverse()
        held = self._held
        if total == len(rows):  # a token each
            for row, slot in zip(rows, slots):
                held[row].append(slot)
            return slots, [row * width + start for row, start in zip(rows, starts)]
        index: List[int] = []
        taken = 0
        for row, start, count in zip(rows, starts, counts):
            held[row].extend(slots[taken:taken + count])
            taken += count
            index.extend(range(row * width + start, row * width + start + count))
        return slots, index

    def release(self, row: int, count: int) -> None:
        """Request row ``row`` and the slots of its first ``count`` positions back (its device table row reset)."""
        held = self._held[row]
        self._free.extend(reversed(held[:count]))
        held.clear()
        self.table.free(row)


__all__ = ["SlotTable"]
