"""The keyword a Hugging Face model's cache travels under: ``cache`` since transformers 5.24,
``past_key_values`` before (still accepted, deprecated, until 5.40). Outputs carry it under the
same name."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Optional

CACHE_KEYWORDS = ("cache", "past_key_values")  # the current name first


def passed_cache_keyword(kwargs: Mapping[str, Any]) -> Optional[str]:
    """The keyword a forward call got its cache under, or None when it got none."""
    return next((name for name in CACHE_KEYWORDS if kwargs.get(name) is not None), None)


def accepted_cache_keyword(forward: Callable[..., Any]) -> Optional[str]:
    """The cache keyword ``forward`` declares (``cache`` on transformers >= 5.24, ``past_key_values`` before), or
    None when it declares neither: a cache passed to it would land in ``**kwargs``, unread (Mamba's forward takes
    ``cache_params`` on transformers 5.17)."""
    parameters = inspect.signature(forward).parameters
    return next((name for name in CACHE_KEYWORDS if name in parameters), None)
