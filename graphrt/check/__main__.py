"""``python -m graphrt.check module:factory``: print the check report, exit 1 on a hazard.

The factory is called with no arguments and returns ``(callable, example_args)``,
``(callable, example_args, example_kwargs)``, or a GraphRunner (optionally as
``(runner, example_batches)``). The module is imported from the current directory too.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Any, List, Optional

from graphrt.check import CheckReport, check

USAGE_ERROR = 2


def load_factory(spec: str) -> Any:
    """``package.module:function`` -> the function."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"factory: expected 'module:function', got {spec!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    target: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        target = getattr(target, part)
    return target


def run_factory(made: Any) -> CheckReport:
    """Check what a factory returned (see the module docstring for the accepted shapes)."""
    if made is None:
        raise ValueError("factory: the factory returned None; expected a GraphRunner, a wrapped callable, "
                         "or (callable, args[, kwargs])")
    if not isinstance(made, tuple):
        return check(made)
    if len(made) == 2:
        fn, args = made
        return check(fn, *args)
    if len(made) == 3:
        fn, args, kwargs = made
        return check(fn, *args, **kwargs)
    raise ValueError(f"factory: expected (callable, args) or (callable, args, kwargs), got a {len(made)}-tuple")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphrt.check", description=__doc__.splitlines()[0])
    parser.add_argument("factory", help="module:function returning (callable, example_args[, example_kwargs])")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the check records")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        made = load_factory(args.factory)()
        report = run_factory(made)
    except (ImportError, AttributeError, ValueError, TypeError) as error:
        print(f"graphrt check: {type(error).__name__}: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(report.to_json() if args.json else report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
