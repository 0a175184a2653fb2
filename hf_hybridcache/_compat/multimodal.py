"""The multimodal rotary positions of a vision-language wrapper's prompt, as ``generate()`` computes them.

Qwen3.5 and Qwen3.5-MoE rotate their queries and keys by 3D positions (temporal, height, width): text tokens count
up as usual, an image's placeholder tokens take its grid's coordinates, and the tokens after an image continue from
the largest position so far plus one. ``generate()`` computes them once from the whole prompt
(``_prepare_position_ids_for_generation``, which calls the inner model's ``get_rope_index``) and then advances the
last prompt position by one per new token (``_update_model_kwargs_for_generation``); the model's forward takes them
as ``position_ids`` ``[4, B, T]`` (row 0 the text positions, rows 1-3 the 3D ones). Private API used:
``Qwen3_5Model.get_rope_index`` (5.23 - 5.24: ``(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw)``).
"""

from __future__ import annotations

import torch

#: ``mm_token_type_ids`` of each placeholder token's config attribute (the processor's: text 0, image 1, video 2).
_TOKEN_TYPES = {"image_token_id": 1, "video_token_id": 2}


def rope_positions(model: torch.nn.Module, input_ids: torch.Tensor, inputs: dict) -> torch.Tensor | None:
    """The 3D rotary positions ``[3, T]`` int64 (on ``input_ids``' device) of the prompt ``input_ids`` ``[1, T]``
    with the pixel inputs ``inputs`` (their ``*_grid_thw``), as ``generate()`` gives them to a cold run; None for a
    model without multimodal rotary positions (the positions are then the token positions)."""
    inner = getattr(model, "model", None)
    if not hasattr(inner, "get_rope_index") or not hasattr(inner, "rope_deltas"):
        return None
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for name, kind in _TOKEN_TYPES.items():
        token_id = getattr(model.config, name, None)
        if token_id is not None:
            types[input_ids == token_id] = kind
    grids = {name: inputs[name] for name in ("image_grid_thw", "video_grid_thw") if inputs.get(name) is not None}
    positions, _ = inner.get_rope_index(input_ids, mm_token_type_ids=types, **grids)
    return positions[:, 0]


def decode_positions(positions: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """The 3D positions ``[3, end - start]`` of token positions ``[start, end)`` of a request whose prompt has the 3D
    positions ``positions`` ``[3, T]``: the prompt's own below ``T``, then its last one plus one per token after it
    (as ``generate()`` advances them over the reply)."""
    prompt_tokens = positions.shape[1]
    inside = positions[:, start:min(end, prompt_tokens)]
    if end <= prompt_tokens:
        return inside
    after = torch.arange(max(start, prompt_tokens), end) - prompt_tokens + 1
    return torch.cat([inside, positions[:, -1:] + after[None]], dim=1)
