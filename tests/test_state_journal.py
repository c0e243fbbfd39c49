"""StateJournal: every in-place write to pre-existing memory is undone, saving only the written region."""

from __future__ import annotations

import pytest
import torch

from graphrt.backends.state_journal import StateJournal


def journaled(step):
    """Run ``step`` under a journal, restore, and return the journal."""
    journal = StateJournal()
    with torch.no_grad():
        with journal:
            step()
        journal.restore()
    return journal


WRITES = {
    "index_put_": lambda big, rows: big.index_put_((rows,), torch.ones(len(rows), 8)),
    "setitem": lambda big, rows: big.__setitem__(rows, 5.0),
    "index_copy_": lambda big, rows: big.index_copy_(0, rows, torch.ones(len(rows), 8)),
    "index_add_": lambda big, rows: big.index_add_(0, rows, torch.ones(len(rows), 8)),
    "index_fill_": lambda big, rows: big.index_fill_(0, rows, 3.0),
    "scatter_": lambda big, rows: big.scatter_(0, rows[:, None].expand(-1, 8), torch.ones(len(rows), 8)),
    "scatter_add_": lambda big, rows: big.scatter_add_(0, rows[:, None].expand(-1, 8), torch.ones(len(rows), 8)),
    "copy_ into a view": lambda big, rows: big[2:4].copy_(torch.ones(2, 8)),
    "add_ on a view of a view": lambda big, rows: big[1:6][1:3].add_(1),
    "out=": lambda big, rows: torch.add(torch.ones(2, 8), 1, out=big[5:7]),
    "row of a select": lambda big, rows: big.select(1, 3).index_put_((rows,), torch.ones(len(rows))),
}


@pytest.mark.parametrize("name", WRITES)
def test_each_writer_is_undone_and_saves_only_its_region(name):
    big = torch.randn(4096, 8)
    before = big.clone()
    rows = torch.tensor([7, 9, 7, 100])  # a duplicate row too
    journal = journaled(lambda: WRITES[name](big, rows))
    assert torch.equal(big, before)
    assert 0 < journal.saved_bytes <= 4 * 8 * 4, f"saved {journal.saved_bytes} bytes for a few rows"


def test_repeated_writes_restore_the_original_values():
    counter = torch.zeros(())
    history = torch.zeros(16)

    def step():
        for _ in range(3):
            counter.add_(1)
            history.index_copy_(0, counter.long().view(1), counter.view(1))

    journaled(step)
    assert counter == 0 and not history.any()


def test_writes_into_memory_allocated_inside_the_block_are_not_saved():
    def step():
        scratch = torch.zeros(1024, 8)
        scratch.add_(1)
        scratch[3:5].copy_(torch.ones(2, 8))

    assert journaled(step).saved_bytes == 0


def test_restore_runs_when_the_block_raises():
    state = torch.zeros(4)
    journal = StateJournal()
    with pytest.raises(RuntimeError, match="boom"):
        try:
            with journal:
                state.add_(1)
                raise RuntimeError("boom")
        finally:
            journal.restore()
    assert not state.any()
