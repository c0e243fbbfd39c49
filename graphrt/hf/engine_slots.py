"""The engine's request rows and KV slots, kept on the host.

Which slots are free, which slots each request row holds and where a step's new tokens go are host
bookkeeping: assigning slots to a step and releasing a finished request touch no device memory (a
released row's table row is reset with one device fill). The request table on the device
(``req_to_token``) is written from the step's staged arena: ``table_index`` (each new token's flat
``row * max_context + position``) beside ``out_cache_loc``, one ``index_copy_`` per step.

With a prefix cache (graphrt.hf.prefix_cache), a row's first positions may point at slots the cache
holds (``share``: written into the row's table once, when the request starts on a cached prefix, and
never freed with the row), its own slots follow; ``adopt`` hands a row's first own slots to the cache
once they are cached. The cache's unlocked slots count as available and are evicted when a step needs
them.
"""

from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple

import torch

from graphrt.hf.prefix_cache import PrefixCache
from graphrt.reference import DUMMY_REQUEST, SCRATCH_SLOT, ReqToTokenPool


class SlotTable:
    """The free KV slots (a stack, never the scratch slot), the free request rows (``ReqToTokenPool``'s own
    host list, never the dummy row) and the slots each row holds, as Python lists (a step assigns a few
    slots: list operations cost less than array calls there), and the prefix cache whose slots a row may
    begin with (``prefixes``; None: no sharing)."""

    def __init__(self, table: ReqToTokenPool, num_slots: int, prefixes: Optional[PrefixCache] = None) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots: expected >= 2 (slot {SCRATCH_SLOT} is reserved), got {num_slots}")
        self.table = table
        self.num_slots = num_slots
        self.width = table.max_context_len
        self._free = list(range(num_slots - 1, 0, -1))  # taken from the end: 1, 2, 3, ...
        self._held: List[List[int]] = [[] for _ in range(table.num_requests)]
        self._shared = [0] * table.num_requests  # each row's first positions whose slots the prefix cache holds
        self.prefixes = prefixes

    @property
    def available(self) -> int:
        """KV slots that can still be assigned (the prefix cache's unlocked ones evicted as needed)."""
        return len(self._free) + (self.prefixes.evictable_tokens if self.prefixes is not None else 0)

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
        if total > len(free) and self.prefixes is not None:
            free.extend(self.prefixes.evict(total - len(free)))
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
        """Request row ``row`` and the slots of its first ``count`` positions back (its device table row reset);
        the slots the prefix cache holds stay the cache's."""
        held = self._held[row]
        self._free.extend(reversed(held[:count - self._shared[row]]))
        held.clear()
        self._shared[row] = 0
        self.table.free(row)

    def owned(self, row: int) -> List[int]:
        """The slots row ``row`` holds itself, in position order after its shared ones (read only)."""
        return self._held[row]

    def shared(self, row: int) -> int:
        """How many first positions of row ``row`` point at the prefix cache's slots."""
        return self._shared[row]

    def share(self, row: int, slots: Sequence[int]) -> None:
        """The next ``len(slots)`` positions of row ``row`` after its shared ones point at the prefix cache's
        ``slots`` (written into the device table); the row's own slots there are freed (a duplicate of a prefix
        another request cached first). The step that computed them was launched before: a later step that is
        assigned them writes after it, in stream order."""
        start, count = self._shared[row], len(slots)
        held = self._held[row]
        self._free.extend(reversed(held[:count]))
        del held[:count]
        self._shared[row] = start + count
        values = torch.tensor(slots, dtype=self.table.req_to_token.dtype,
                              pin_memory=self.table.device.type == "cuda")
        self.table.req_to_token[row, start:start + count].copy_(values, non_blocking=True)

    def adopt(self, row: int, count: int) -> None:
        """The first ``count`` slots row ``row`` holds itself are the prefix cache's from now on (it cached them)."""
        del self._held[row][:count]
        self._shared[row] += count

    def clear_prefixes(self) -> None:
        """Every slot of the prefix cache back to the free slots (no running request may read it)."""
        if self.prefixes is not None:
            self._free.extend(self.prefixes.clear())


__all__ = ["SlotTable"]
