"""Where a piecewise step splits: the splitting-op calls of a recording, by model line.

A splitting op (``RunnerConfig.splitting_ops``) runs eagerly between graph pieces; the report
lists each call site with its model line and how many times the step reaches it (a loop over
layers), and the number of graph pieces that makes. ``piece_refusal`` runs the step under the
watcher piecewise capture uses, so what capture would refuse is reported before capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from graphrt.check.recording import Recording, ScanRecorder, source_text
from graphrt.piecewise.split import PiecewiseCaptureError, SplitWatcher


class SplitScanRecorder(ScanRecorder):
    """A ScanRecorder that records a splitting op as one op and notes no host read inside it: the
    op runs eagerly between pieces, where reading host values is allowed."""

    def __init__(self, splitting: Any) -> None:
        super().__init__()
        self.splitting = splitting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if not self.splitting.match(func):
            return super().__torch_dispatch__(func, types, args, kwargs)
        with self.host_reads_allowed():
            return super().__torch_dispatch__(func, types, args, kwargs)


@dataclass
class SplitSite:
    """One model line that calls a splitting op: the step splits there ``count`` times."""

    op: str
    source: Optional[str]
    count: int


def split_sites(recording: Recording, splitting: Any) -> Tuple[List[SplitSite], int]:
    """The split sites of one recorded step (``splitting``: a SplittingOps) and the pieces they make."""
    sites: Dict[Tuple[str, Optional[str]], SplitSite] = {}
    calls = 0
    for op in recording.ops:
        name = splitting.match(op.func) if hasattr(op.func, "_schema") else ""
        if name:
            calls += 1
            source = source_text(op.source)
            site = sites.get((name, source))
            if site is None:
                site = sites[(name, source)] = SplitSite(name, source, 0)
            site.count += 1
    return list(sites.values()), calls + 1


class _InlineSplits:
    """A piece sink that keeps no pieces: the splitting op just runs."""

    def split(self, run: Callable[[], Any]) -> Any:
        return run()


def piece_refusal(step: Callable[[], Any], splitting: Any, request_fields: Mapping[Any, str]
                  ) -> Optional[PiecewiseCaptureError]:
    """Why piecewise capture would refuse ``step`` (a request-shaped read in a piece, an op it
    cannot place, a splitting op never called), or None. The caller undoes the step's writes."""
    watcher = SplitWatcher(splitting, request_fields, _InlineSplits())
    try:
        with watcher:
            step()
        watcher.check_all_called()
    except PiecewiseCaptureError as error:
        return error
    return None
