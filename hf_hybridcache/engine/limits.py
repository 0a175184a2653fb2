"""The engine's memory bounds, separate from the stored-cache budget (``max_cache_bytes``).

Three things grow with the running batch: the state slots (one conv + recurrent state per running request and
recurrent layer, allocated once), the KV pages running requests wrote and the store does not own (their private
pages; pages shared from a hit are stored blocks, counted in the cache's budget), and the activations of one step
(tokens per step). A request that does not fit waits; a running request that cannot get a page is preempted (its
slot and private pages are given back, and it resumes later from the store: :mod:`~hf_hybridcache.engine.scheduler`).
Nothing is allocated beyond these bounds, so the engine never runs out of memory by its own doing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch

from ..config import ModelStateSpec

#: Fraction of the free device memory (after the model and the stored-cache budget) the engine may use.
DEFAULT_MEMORY_FRACTION = 0.5
#: Bytes of activations per token of a step, in units of ``hidden_size * dtype bytes`` (residual, norms, MLP
#: intermediates and attention scores of one layer at a time, with room to spare).
ACTIVATION_FACTOR = 64


@dataclass(frozen=True)
class EngineLimits:
    """Bounds of one engine.

    Attributes:
        max_running_requests: requests admitted at once (state slots).
        max_batch_tokens: tokens in one step (one per decoding request, the rest prefill chunks).
        max_running_pages: KV pages running requests may hold that the store does not own (``block_size`` tokens
            each).
        max_request_tokens: prompt + new tokens of one request (the model's positions, and what fits the pages).
        max_score_bytes: bytes of the prompt logprobs kept for requests that ask for them
            (:mod:`~hf_hybridcache.engine.score_store`; host memory, apart from the cache's budget).

    Raises:
        ValueError: a bound that is not a positive int.
    """

    max_running_requests: int = 32
    max_batch_tokens: int = 512
    max_running_pages: int = 4096
    max_request_tokens: int = 32768
    max_score_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "max_batch_tokens", "max_running_pages", "max_request_tokens",
                     "max_score_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")

    @classmethod
    def from_device(
        cls,
        model: torch.nn.Module,
        spec: ModelStateSpec,
        max_cache_bytes: int,
        max_running_requests: int | None = None,
        max_batch_tokens: int | None = None,
        max_running_pages: int | None = None,
        memory_fraction: float | None = None,
    ) -> EngineLimits:
        """Bounds for ``model`` on its device: the given ones, and for the others a share of the device's free
        memory (CUDA: ``mem_get_info``; CPU: psutil's available memory) minus what the stored cache may still
        take. Pages and slots are allocated as they are used, so a generous bound costs nothing until then."""
        device = model.device
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else psutil.virtual_memory().available
        fraction = DEFAULT_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        usable = max(int(free * fraction) - max_cache_bytes, 0)
        config = model.config.get_text_config()
        requests = max_running_requests or cls.max_running_requests
        tokens = max_batch_tokens or cls.max_batch_tokens
        activations = tokens * config.hidden_size * model.dtype.itemsize * ACTIVATION_FACTOR
        page_bytes = max(spec.kv_block_bytes, 1)
        pages = max_running_pages or max((usable - requests * spec.checkpoint_bytes - activations) // page_bytes, 1)
        positions = getattr(config, "max_position_embeddings", None) or cls.max_request_tokens
        return cls(
            max_running_requests=requests,
            max_batch_tokens=tokens,
            max_running_pages=int(pages),
            max_request_tokens=int(min(positions, pages * spec.block_size)),
        )

    def pages_for(self, num_tokens: int, block_size: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return math.ceil(num_tokens / block_size)
