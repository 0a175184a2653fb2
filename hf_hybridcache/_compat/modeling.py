"""Module-level functions of transformers' modeling files that the linear-attention mixers call by name."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable


def route_module_function(module_name: str, name: str, router: Callable) -> None:
    """Make ``module_name.name(*args, **kwargs)`` call ``router(original, *args, **kwargs)`` (idempotent).

    The mixers call their recurrence kernels (``torch_chunk_gated_delta_rule`` and kin) by their module-level name,
    so the name is rebound once in the modeling module; ``router`` must call ``original`` unchanged outside this
    package's own mixer calls, so every other model of the family runs exactly as before. ``original`` is whatever
    transformers bound there (its torch path, or the ``fla`` kernel when that package is installed).
    """
    module = sys.modules[module_name]
    original = getattr(module, name)
    if getattr(original, "_hf_hybridcache_routed", False):
        return

    @functools.wraps(original)
    def routed(*args, **kwargs):
        return router(original, *args, **kwargs)

    routed._hf_hybridcache_routed = True
    setattr(module, name, routed)
