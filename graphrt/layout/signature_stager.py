"""SignatureStager: a wrapped function's call staged into one layout's static slots, and back.

The entry of a ``wrap()`` key stages through it (graphrt.entry): the call's tensors copied into
the slots of its ``CallSignature`` before a replay, and the arguments the graph writes in place
copied back into the caller's tensors after it.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, List, Sequence, Set, Tuple

import torch

from graphrt.entry import GraphEntry
from graphrt.layout.call_signature import CallSignature

logger = logging.getLogger(__name__)


class SignatureStager:
    """Stages a call into the static slots of one layout (``CallSignature.stage``) and writes
    arguments the graph writes in place back into the caller's tensors."""

    __slots__ = ("signature", "sources")

    def __init__(self, signature: CallSignature) -> None:
        self.signature = signature
        positions = signature.tensor_positions
        # The call's tensors (the aliasing guard reads their memory): the getter itself, no frame per call.
        self.sources: Callable[[List[Any]], Sequence[torch.Tensor]]
        if len(positions) > 1:
            self.sources = operator.itemgetter(*positions)
        else:  # an itemgetter of one position returns the leaf itself
            self.sources = lambda leaves: tuple(leaves[position] for position in positions)

    def stage(self, entry: GraphEntry, leaves: List[Any], num_tokens: int, num_reqs: int) -> None:
        self.signature.stage(leaves, num_tokens)

    def reset(self) -> None:
        self.signature.buffers.reset()

    def written(self, storages: Set[Tuple[torch.device, int]]) -> Tuple[int, ...]:
        positions = self.signature.written(storages)
        if positions:
            logger.info("wrap(): the function writes %s in place; replays copy it back to the caller",
                        ", ".join(self.signature.written_paths(positions)))
        return positions

    def write_back(self, entry: GraphEntry, leaves: List[Any], num_tokens: int, num_reqs: int) -> None:
        self.signature.write_back(leaves, num_tokens, entry.key.num_tokens, entry.written_inputs)
