"""Which implementation the kernel ops run: the plain-torch reference, the fast torch path, or Triton.

``"auto"`` (the default) picks Triton for CUDA tensors when ``triton`` is importable and the fast torch path
otherwise (CPU, or CUDA without Triton, with one warning). ``"reference"`` forces the token-by-token / plain-copy
references everywhere, e.g. to rule a kernel out when outputs look wrong. The environment variable
``HF_HYBRIDCACHE_KERNELS`` sets the starting choice; :func:`set_backend` and :func:`use_backend` change it in code.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings

import torch

BACKENDS = ("auto", "reference", "torch", "triton")
ENV_VAR = "HF_HYBRIDCACHE_KERNELS"


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"Unknown kernel backend {name!r} (from {source}); use one of {', '.join(BACKENDS)}.")
    return name


_backend = _checked(os.environ.get(ENV_VAR, "auto"), f"the environment variable {ENV_VAR}")
_warned_no_triton = False


def get_backend() -> str:
    """The backend name in force (one of :data:`BACKENDS`)."""
    return _backend


def set_backend(name: str) -> str:
    """Make every kernel op use ``name`` (one of :data:`BACKENDS`) from now on; returns the previous name.

    Raises:
        ValueError: ``name`` is not a backend.
    """
    global _backend
    previous, _backend = _backend, _checked(name, "set_backend()")
    return previous


@contextlib.contextmanager
def use_backend(name: str):
    """Context manager form of :func:`set_backend`; restores the previous backend on exit."""
    previous = set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``), which accepts CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(device: torch.device, fast: str = "torch") -> str:
    """The implementation an op on ``device`` runs: ``"reference"``, ``fast`` (the op's fast torch path, or
    ``"reference"`` for ops whose reference is already the torch path) or ``"triton"``.

    Raises:
        ValueError: ``"triton"`` was forced for CPU tensors outside the interpreter, or without ``triton`` installed.
    """
    global _warned_no_triton
    if _backend == "reference":
        return "reference"
    if _backend == "torch":
        return fast
    if _backend == "triton":
        if not triton_available():
            raise ValueError("The 'triton' kernel backend was forced but triton is not installed; pip install triton.")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"The 'triton' kernel backend was forced for {device.type} tensors; Triton kernels need CUDA tensors, "
                "or TRITON_INTERPRET=1 set before the first kernel import to run them on CPU in the interpreter."
            )
        return "triton"
    if device.type == "cuda":
        if triton_available():
            return "triton"
        if not _warned_no_triton:
            warnings.warn(
                "triton is not installed; hf_hybridcache uses its torch kernels on CUDA (pip install triton)."
            )
            _warned_no_triton = True
    return fast
