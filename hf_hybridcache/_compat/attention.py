"""Grouped-query SDPA for a replay over a restored prefix (transformers' ``integrations/sdpa_attention.py``).

A hit replays its tail with the prefix's keys already cached, so each attention call has more keys than queries and
transformers passes an explicit causal mask. With a mask, ``sdpa_attention_forward`` does not use SDPA's own
grouped-query mode (``enable_gqa``, torch >= 2.5): ``use_gqa_in_sdpa`` says no and ``repeat_kv`` copies the keys and
values once per query head of each KV head (Qwen3.5-0.8B: 4 copies of 4096 keys x 2 heads x 256 per layer and call).
On CPU, torch's flash-attention kernel takes the mask and ``enable_gqa`` together and returns the same output bit for
bit (the same kernel over the same rows), without the copies: half the attention time of a 64-token tail over 4096
restored tokens. So inside this package's forwards on CPU tensors, ``use_gqa_in_sdpa`` answers as for an unmasked
call; everywhere else (other models, CUDA, where the masked ``enable_gqa`` path may fall back to the math kernel) it
is transformers' own answer, and so it is for forwards with grad enabled (training: a gradient-checkpointed layer
recomputes its forward in backward, outside the package's forward). One-query calls keep transformers' ``pack_gqa`` path, which copies nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import torch

from .modeling import route_module_function

_SDPA_MODULE = "transformers.integrations.sdpa_attention"
_IN_PACKAGE_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_hybridcache_forward", default=False)


def _use_gqa_router(original, attention_mask: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor) -> bool:
    masked_multi_query = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-2] > 1
    # Only without grad: a gradient-checkpointed layer recomputes its forward in backward, outside the package's
    # forward, and must see the same tensors (repeat_kv's copies) as the first time.
    inference = _IN_PACKAGE_FORWARD.get() and not torch.is_grad_enabled()
    if inference and masked_multi_query and key.device.type == "cpu":
        return original(None, key, value)
    return original(attention_mask, key, value)


def route_grouped_query_sdpa() -> None:
    """Route ``use_gqa_in_sdpa`` (idempotent); it answers as before outside :func:`package_forward`."""
    module = importlib.import_module(_SDPA_MODULE)
    if hasattr(module, "use_gqa_in_sdpa"):
        route_module_function(_SDPA_MODULE, "use_gqa_in_sdpa", _use_gqa_router)


def in_package_forward() -> bool:
    """Whether this thread runs inside :func:`package_forward` (a forward with this package's cache)."""
    return _IN_PACKAGE_FORWARD.get()


@contextlib.contextmanager
def package_forward():
    """Marks a forward that runs with this package's cache (see the module docstring)."""
    token = _IN_PACKAGE_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_PACKAGE_FORWARD.reset(token)
