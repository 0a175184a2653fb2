"""Scan and copy kernels, each with a plain-torch reference beside it, and the switch between them.

Triton kernels live in ``*_triton`` modules that are imported only when a Triton backend runs, so the package works
without ``triton`` installed.
"""

from .backend import BACKENDS, get_backend, set_backend, use_backend
from .mamba1_scan import selective_scan, selective_scan_chunked, selective_scan_ref

__all__ = [
    "BACKENDS",
    "get_backend",
    "selective_scan",
    "selective_scan_chunked",
    "selective_scan_ref",
    "set_backend",
    "use_backend",
]
