"""Piecewise graphs: steps no full graph serves replay graph pieces around eager splitting ops.

``keys.add_piecewise_keys`` (one more kind of key in the runner's registry), ``graph`` (the graph
of pieces and its recorder, through the backend's piece sink), ``split`` (the dispatch mode that
cuts a step at splitting ops and refuses what a piece cannot replay), ``ops`` (the
``splitting_ops`` option).
"""

from graphrt.piecewise.keys import add_piecewise_keys
from graphrt.piecewise.ops import SplittingOps, SplittingOpSpec, resolve_splitting_ops
from graphrt.piecewise.split import PiecewiseCaptureError

__all__ = ["PiecewiseCaptureError", "SplittingOpSpec", "SplittingOps", "add_piecewise_keys", "resolve_splitting_ops"]
