"""Which forward paths a cache installs on its model: the default one (the float32 decode-linear route, the family's
kernel notices) or deterministic mode's (:mod:`.deterministic`). A model instance serves one mode for its life."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config import ModelStateSpec
from . import decode_linear, deterministic
from .base import ModelSupport


def check_mode(model: torch.nn.Module, spec: ModelStateSpec, on: bool) -> None:
    """Refuse ``model`` for the mode ``on`` (deterministic or not) before anything is patched.

    Raises:
        ValueError: :func:`~hf_hybridcache.models.deterministic.check`'s refusals when ``on``; in either mode, the
            model already serves a cache of the other one.
        TypeError: ``on`` is not a bool.
    """
    if not isinstance(on, bool):
        raise TypeError(f"deterministic must be True or False, got {on!r}.")
    if on:
        deterministic.check(model, spec)
    deterministic.check_served_mode(model, on)


def install_forward_paths(model: torch.nn.Module, support: ModelSupport, devices: Iterable[torch.device],
                          on: bool) -> None:
    """After the family's own patches (``support.install``): deterministic mode's paths when ``on``, else the
    decode-linear route and the family's notices of which kernels run (``devices``: the layers' devices)."""
    deterministic.claim(model, on)
    if on:
        deterministic.install(model)  # its own kernels: the default paths' notices do not apply
    else:
        decode_linear.install(model)
        support.explain_kernels(model, devices)
