"""Piecewise graphs: steps no full graph serves replay graph pieces around eager splitting ops.

``runtime.PiecewiseGraphs`` (keys, capture, dispatch, replay), ``capture.PiecewiseBackend``
(capture in pieces through the shared capture sequence), ``split`` (the dispatch mode that cuts
a step at splitting ops), ``sinks`` (per-backend pieces), ``ops`` (the ``splitting_ops`` option).
"""

from graphrt.piecewise.ops import SplittingOps, SplittingOpSpec, resolve_splitting_ops
from graphrt.piecewise.runtime import PiecewiseGraphs
from graphrt.piecewise.split import PiecewiseCaptureError

__all__ = ["PiecewiseCaptureError", "PiecewiseGraphs", "SplittingOpSpec", "SplittingOps", "resolve_splitting_ops"]
