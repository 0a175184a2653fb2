"""What one patched mixer call asks of the code it calls: the states after given token counts.

A linear-attention or short-conv mixer is not copied into this package; its upstream forward runs unchanged, and
the two places it hands its state to anything are intercepted while an :class:`Emission` is active (a context
variable, so threads and nested calls stay apart):

- ``cache.update_conv_state(conv_inputs [B, C, T], layer_idx, ...)``, which the live cache routes to
  :meth:`Emission.capture_conv` before updating the layer: the conv windows at the positions are cut from its inputs.
- the module-level recurrence kernel (``torch_chunk_gated_delta_rule`` and kin), which ``_compat`` routes through
  :func:`run_kernel` so that the recurrent states at the positions come back with the output.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..config import StateKey
from .mamba1 import conv_states_at

_ACTIVE: contextvars.ContextVar[Emission | None] = contextvars.ContextVar("hf_hybridcache_emission", default=None)


@dataclass
class Emission:
    """The states one mixer call must hand over.

    Attributes:
        key: cache layer of the mixer, or ``(layer idx, state idx)`` for a layer's later states.
        positions: sorted token counts ``1 <= t < T`` of the call's ``T`` tokens.
        conv: conv windows ``[B, C, W]`` after each position (model dtype), once ``update_conv_state`` ran.
        recurrent: recurrent states after each position (e.g. ``[B, H, Dk, Dv]`` float32), once the kernel ran.
    """

    key: StateKey
    positions: tuple[int, ...]
    conv: list[torch.Tensor] | None = None
    recurrent: list[torch.Tensor] | None = field(default=None)

    def capture_conv(self, conv_inputs: torch.Tensor, conv_state: torch.Tensor | None, width: int) -> None:
        """Cut the conv window (the last ``width`` raw conv inputs, zero-padded on a fresh prompt) after each
        position from the call's inputs ``[B, C, T]`` and the layer's conv state ``[B, C, W]`` before the call."""
        self.conv = conv_states_at(conv_inputs, conv_state, width, self.positions)


def active() -> Emission | None:
    """The emission of the running mixer call, or None."""
    return _ACTIVE.get()


@contextlib.contextmanager
def emitting(key: StateKey, positions: Sequence[int]) -> Iterator[Emission]:
    """Make an :class:`Emission` active for the duration of one mixer call."""
    emission = Emission(key, tuple(positions))
    token = _ACTIVE.set(emission)
    try:
        yield emission
    finally:
        _ACTIVE.reset(token)
