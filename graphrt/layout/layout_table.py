"""LayoutTable: the call layouts one wrapped function has seen, each with graphs of its own.

A call layout is a CallSignature (argument structure, non-batch dims, dtypes, constants) under
one global state (a ``graphrt.guards.StateWatch`` token: autocast, and the number of the Python
state its calls are in), so a call under autocast, or after ``model.eval()`` or an adapter switch,
gets graphs of its own instead of replaying ones captured under another state. A call is matched against the layout used last (steady decode pays one match, as with a single
layout); on a miss, one dict lookup on the call's positional count and keyword names finds the
few layouts that could fit, most recent first. A call that fits none refines one of them (a
batch axis decided, see CallSignature.refine) or opens a new layout.

Two bounds keep the table small:

* at most ``max_layouts`` layouts hold graphs; opening one more drops the least recently used
  layout and its graphs (their memory is freed once nothing else holds their tensors);
* a layout *family* (layouts that differ only in tensor sizes: a growing 2-D attention mask, a
  growing DynamicCache) that opened ``churn_limit`` layouts in a row without any of them
  recording a graph opens no more: such calls run eagerly, and ``churn`` says why in words.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, Tuple, TypeVar

from graphrt.layout.call_signature import CallSignature

logger = logging.getLogger(__name__)

Graphs = TypeVar("Graphs")


@dataclass(eq=False)
class Layout(Generic[Graphs]):
    """One call layout: its signature and what the owner keeps for it (wrap(): its graphs)."""

    number: int  # 0 for the first layout opened, then 1, 2, ... (names its keys in stats)
    signature: CallSignature
    graphs: Graphs
    family: Hashable
    bucket: Hashable
    state: Hashable = None  # the global state its calls are made under (graphrt.guards.StateWatch)


# A call's layout (None: its kind of layout keeps changing, it runs eagerly), leaves and batch size.
# A plain tuple: built on every call.
Found = Tuple[Optional[Layout], List[Any], int]


def _match(signature: CallSignature, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[List[Any], int, bool]:
    """The call's leaves and batch size, and whether it fits ``signature`` (narrowing a tentative one)."""
    leaves, structure = signature.flatten(args, kwargs)
    batch_size, matched = signature.match(leaves, structure)
    if matched and signature.tentative:
        signature.confirm(leaves, structure)
    return leaves, batch_size, matched


class LayoutTable(Generic[Graphs]):
    """Layouts by recency, found per call in O(1); bounded in number and in churn."""

    def __init__(
        self,
        max_batch_size: int,
        max_layouts: int,
        churn_limit: int,
        make_graphs: Callable[[CallSignature], Graphs],
        drop_graphs: Callable[[Graphs], None],
    ) -> None:
        if max_layouts < 1:
            raise ValueError(f"max_signatures: expected an int >= 1, got {max_layouts!r}")
        self.max_batch_size = max_batch_size
        self.max_layouts = max_layouts
        self.churn_limit = churn_limit
        self._make_graphs = make_graphs
        self._drop_graphs = drop_graphs
        self.layouts: "OrderedDict[int, Layout[Graphs]]" = OrderedDict()  # least recently used first
        self._buckets: Dict[Hashable, List[Layout[Graphs]]] = {}
        self._current: Optional[Layout[Graphs]] = None
        self._unrecorded: Dict[Hashable, int] = {}  # family (of a layout held) -> opened since one of it recorded
        self.opened = 0
        self.dropped = 0
        self.refined = 0
        self.churn: Dict[str, str] = {}  # argument path -> why calls changing it run eagerly

    @property
    def current(self) -> Optional[Layout[Graphs]]:
        return self._current

    def find(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], state: Hashable = None) -> Found:
        """The layout this call, made under global ``state``, fits (refined or opened if need be),
        its leaves and batch size."""
        current = self._current
        if current is not None and (current.state is state or current.state == state):
            leaves, batch_size, matched = _match(current.signature, args, kwargs)
            if matched:
                return current, leaves, batch_size
        return self._find_other(args, kwargs, state)

    def _find_other(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], state: Hashable) -> Found:
        bucket_key = (len(args), frozenset(kwargs), state)
        bucket = self._buckets.get(bucket_key, ())
        for layout in reversed(bucket):  # most recent first
            leaves, batch_size, matched = _match(layout.signature, args, kwargs)
            if matched:
                return self._use(layout), leaves, batch_size
        for layout in reversed(bucket):
            leaves, structure = layout.signature.flatten(args, kwargs)
            refined = layout.signature.refine(leaves, structure)
            if refined is not None:
                return self._refine(layout, refined), leaves, refined.match(leaves, structure)[0]
        signature = CallSignature.first_call(args, kwargs, self.max_batch_size)
        leaves, structure = signature.flatten(args, kwargs)
        batch_size = signature.match(leaves, structure)[0]
        family = (signature.family(), state)
        if self._unrecorded.get(family, 0) >= self.churn_limit:
            self._explain_churn(family, leaves, structure)
            return None, leaves, batch_size
        return self._open(signature, family, bucket_key, state), leaves, batch_size

    def _use(self, layout: Layout[Graphs]) -> Layout[Graphs]:
        self.layouts.move_to_end(layout.number)
        bucket = self._buckets[layout.bucket]
        bucket.remove(layout)
        bucket.append(layout)
        self._current = layout
        return layout

    def _refine(self, layout: Layout[Graphs], signature: CallSignature) -> Layout[Graphs]:
        """Replace a layout's signature by a refined one: its graphs are dropped and captured again."""
        self.refined += 1
        logger.info("wrap(): argument layout is now %s; graphs are captured again", signature.layout())
        layout.signature = signature
        self.renew(layout)
        return self._use(layout)

    def renew(self, layout: Layout[Graphs]) -> None:
        """Drop a layout's graphs for fresh ones, warmed up and recorded again on later calls."""
        self._drop_graphs(layout.graphs)
        layout.graphs = self._make_graphs(layout.signature)

    def _open(self, signature: CallSignature, family: Hashable, bucket_key: Hashable, state: Hashable) -> Layout[Graphs]:
        while len(self.layouts) >= self.max_layouts:
            self._drop(next(iter(self.layouts.values())))
        layout: Layout[Graphs] = Layout(self.opened, signature, None, family, bucket_key, state)
        if self.opened:
            logger.info("wrap(): new argument layout %d: %s", layout.number, signature.layout())
        self.opened += 1
        self.layouts[layout.number] = layout
        self._buckets.setdefault(bucket_key, []).append(layout)
        self._unrecorded[family] = self._unrecorded.get(family, 0) + 1
        self._current = layout
        try:
            layout.graphs = self._make_graphs(signature)
        except BaseException:  # a bad option for this layout (a pad value its tensor cannot hold)
            self._remove(layout)
            raise
        return layout

    def _drop(self, layout: Layout[Graphs]) -> None:
        """Forget the least recently used layout and its graphs (max_signatures reached)."""
        logger.info("wrap(): %d layouts hold graphs (max_signatures): dropping layout %d, least recently used",
                    len(self.layouts), layout.number)
        self._remove(layout)
        self._drop_graphs(layout.graphs)
        self.dropped += 1

    def _remove(self, layout: Layout[Graphs]) -> None:
        del self.layouts[layout.number]
        bucket = self._buckets[layout.bucket]
        bucket.remove(layout)
        if not bucket:
            del self._buckets[layout.bucket]
        if not any(held.family == layout.family for held in self.layouts.values()):
            del self._unrecorded[layout.family]  # a family with no layout held starts afresh
        if self._current is layout:
            self._current = None

    def recorded(self, layout: Layout[Graphs]) -> None:
        """A graph of ``layout`` was recorded: its family is not churning."""
        self._unrecorded[layout.family] = 0

    def _explain_churn(self, family: Hashable, leaves: List[Any], structure: Any) -> None:
        """Say once per argument path why calls like this one run eagerly (``stats()["layout_churn"]``)."""
        last = next(layout for layout in reversed(self.layouts.values()) if layout.family == family)
        path, why = last.signature.first_difference(leaves, structure)
        if path not in self.churn:
            count = self._unrecorded[family]
            self.churn[path] = (
                f"calls keep bringing new argument layouts ({count} in a row, none called often enough to record "
                f"a graph); the last one changed {path}: {why}. Calls like this run eagerly (shape_mismatch). An "
                "argument whose shape changes on every call (a growing 2-D attention mask, a DynamicCache) cannot "
                "be graphed: give it a fixed shape (Hugging Face: generate(..., cache_implementation='static'))"
            )
            logger.warning("wrap(): %s", self.churn[path])
