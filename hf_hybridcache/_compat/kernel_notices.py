"""transformers' "falling back" notices for the kernels whose work the patched mixers do with this package's scans.

transformers wraps each optional kernel of a modeling file (``selective_scan_fn``, ``causal_conv1d_fn``,
``mamba_chunk_scan_combined``, ``chunk_gated_delta_rule`` ...) in ``use_kernel_func_from_hub_with_fallback``
(``transformers/integrations/hub_kernels.py``, 5.23 - 5.24), which logs once per process, the first time the wrapper
runs its torch path: "`<name>` is falling back to its reference PyTorch implementation because `<package>` is not
installed. This is correct but much slower; install `<package>` for the optimized kernel."

In a model patched by a HybridPrefixCache, the Mamba-1 and Mamba-2 prefills that store checkpoints (or continue a
restored Mamba-1 state) run this package's scan instead, which no such package would speed up, so the notice is not
true of them. Inside the forwards such a model runs with its cache, the notices of the kernels its family's scan stands
in for are dropped (a logging filter on transformers' ``hub_kernels`` logger); the package logs one line of its own
that says which path runs what (``ModelSupport.explain_kernels``). Every other notice (the decode step's
``selective_state_update``, the gated delta rule's, a short conv's) and every notice outside those forwards is left
alone. transformers remembers a message once logged, filtered or not, so a notice dropped inside such a forward is
not repeated for another model later in the same process.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch

#: The logger ``use_kernel_func_from_hub_with_fallback`` logs its notices with.
HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
#: The kernel names whose notices the forward running in this thread (or task) drops.
_QUIET: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("hf_hybridcache_quiet", default=frozenset())


class _DropStandInNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        quiet = _QUIET.get()
        if not quiet:
            return True
        message = record.getMessage()
        return not any(message.startswith(f"`{name}` is falling back") for name in quiet)


_FILTER = _DropStandInNotices()


def quiet_kernel_notices(model: torch.nn.Module, kernels: tuple[str, ...]) -> None:
    """Drop transformers' "falling back" notices of ``kernels`` (names as the notices spell them) inside this model
    instance's forwards with the package's cache (idempotent; other models keep every notice)."""
    model._hf_hybridcache_quiet_kernels = frozenset(kernels)
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


@contextlib.contextmanager
def package_forward(model: torch.nn.Module):
    """Around one forward of ``model`` with the package's cache: its quieted notices are dropped."""
    token = _QUIET.set(vars(model).get("_hf_hybridcache_quiet_kernels", frozenset()))
    try:
        yield
    finally:
        _QUIET.reset(token)
