"""Scan and gather kernels, each with a plain-torch reference beside it."""

from .mamba1_scan import selective_scan, selective_scan_ref

__all__ = ["selective_scan", "selective_scan_ref"]
