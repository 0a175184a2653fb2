"""Scan and gather kernels, each with a plain-torch reference beside it."""

from .mamba1_scan import selective_scan, selective_scan_ref
from .mamba2_scan import mamba2_chunk_scan, mamba2_chunk_scan_ref, mamba2_recurrent_ref

__all__ = [
    "mamba2_chunk_scan",
    "mamba2_chunk_scan_ref",
    "mamba2_recurrent_ref",
    "selective_scan",
    "selective_scan_ref",
]
