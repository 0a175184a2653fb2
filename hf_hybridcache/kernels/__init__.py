"""Scan, delta-rule and copy kernels, each with a plain-torch reference beside it, and the switch between them.

Triton kernels live in ``*_triton`` modules that are imported only when a Triton backend runs, so the package works
without ``triton`` installed.
"""

from .backend import BACKENDS, get_backend, set_backend, use_backend
from .gated_delta import chunk_gated_delta_rule, gated_delta_steps, recurrent_gated_delta_rule
from .kda import chunk_kimi_delta_attention, kimi_delta_steps, recurrent_kimi_delta_attention
from .mamba1_scan import selective_scan, selective_scan_chunked, selective_scan_ref
from .mamba2_scan import mamba2_chunk_scan, mamba2_chunk_scan_ref, mamba2_recurrent_ref
from .paged_copy import (
    copy_states,
    copy_states_ref,
    gather_kv_blocks,
    gather_kv_blocks_ref,
    scatter_kv_blocks,
    scatter_kv_blocks_ref,
)

__all__ = [
    "BACKENDS",
    "chunk_gated_delta_rule",
    "chunk_kimi_delta_attention",
    "copy_states",
    "copy_states_ref",
    "gated_delta_steps",
    "gather_kv_blocks",
    "gather_kv_blocks_ref",
    "get_backend",
    "kimi_delta_steps",
    "mamba2_chunk_scan",
    "mamba2_chunk_scan_ref",
    "mamba2_recurrent_ref",
    "recurrent_gated_delta_rule",
    "recurrent_kimi_delta_attention",
    "scatter_kv_blocks",
    "scatter_kv_blocks_ref",
    "selective_scan",
    "selective_scan_chunked",
    "selective_scan_ref",
    "set_backend",
    "use_backend",
]
