"""The vision-language wrappers served, and where each keeps its images: which keyword arguments carry an image's
pixels and grid, how many pixel rows and placeholder tokens each image takes, and which feature method encodes them.

An *item* is what a wrapper's ``get_<modality>_features`` returns one entry of ``pooler_output`` for (an image, a
video, or for LFM2-VL one tile), or for Inkling, whose tower encodes every patch on its own into the token it fills,
one run of consecutive placeholder tokens. Item ``k``'s placeholders are the placeholder tokens of its modality that
follow item ``k - 1``'s, in prompt order, as every wrapper's ``masked_scatter`` fills them. Upstream:
``transformers/models/{qwen3_5, qwen3_5_moe, lfm2_vl, lfm3_vl, nemotron_h_omni, inkling, inkling2}/modeling_*.py``
(5.23.0, 5.24.0) and ``models/inkling2_loop/modeling_inkling2_loop.py`` (5.24.0: Inkling 2's image inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Modality:
    """How one wrapper keeps the items of one modality.

    Attributes:
        name: ``"image"`` or ``"video"``: the key of ``mm_encoder_outputs`` and of ``get_<name>_features``.
        token_id: the config attribute holding its placeholder token id.
        pixels: the keyword argument whose dim 0 is split among the items.
        grid: the keyword argument with one row per item (its grid), or None (items are runs of placeholders).
        per_item: other keyword arguments with one row per item.
        pixel_rows: ``(grid [N, k], config) -> rows of `pixels` per item`` (None: one row per placeholder token).
        feature_rows: ``(grid [N, k], config) -> placeholder tokens per item`` (None: the runs' lengths).
        padding_mask: the keyword argument (one of ``per_item``) whose row marks an item's real pixel rows along
            dim 1 of its ``pixels``, padded past them to the longest item of the call (LFM2-VL's tiles): the digest
            reads only up to its last real row, so an item's key does not depend on the other items beside it.
    """

    name: str
    token_id: str
    pixels: str
    grid: str | None = None
    per_item: tuple[str, ...] = ()
    pixel_rows: Callable[[torch.Tensor, object], list[int]] | None = None
    feature_rows: Callable[[torch.Tensor, object], list[int]] | None = None
    padding_mask: str | None = None

    @property
    def inputs(self) -> tuple[str, ...]:
        """The keyword arguments of this modality's feature method."""
        return (self.pixels,) + ((self.grid,) if self.grid else ()) + self.per_item


def _products(grid: torch.Tensor, config) -> list[int]:
    return grid.prod(-1).tolist()


def _merged(grid: torch.Tensor, config) -> list[int]:
    """Patches per item over the square of the vision config's ``spatial_merge_size``."""
    return (grid.prod(-1) // config.vision_config.spatial_merge_size**2).tolist()


def _one_each(grid: torch.Tensor, config) -> list[int]:
    return [1] * grid.shape[0]


def _downsampled(grid: torch.Tensor, config) -> list[int]:
    """LFM2-VL: a tile's patch grid after the projector's pixel unshuffle by ``downsample_factor``."""
    return ((grid // config.downsample_factor).prod(-1)).tolist()


def _quartered(grid: torch.Tensor, config) -> list[int]:
    """Nemotron-H Omni: the pixel shuffle makes one token of 2 x 2 patches (``get_image_features``)."""
    return (grid.prod(-1) // 4).tolist()


def _qwen_like(image_grid: str = "image_grid_thw") -> tuple[Modality, ...]:
    return (
        Modality("image", "image_token_id", "pixel_values", image_grid, (), _products, _merged),
        Modality("video", "video_token_id", "pixel_values_videos", "video_grid_thw", (), _products, _merged),
    )


#: ``model_type`` of a wrapper -> the modalities whose items the cache keys blocks by and skips on a hit.
WRAPPERS: dict[str, tuple[Modality, ...]] = {
    "qwen3_5": _qwen_like(),
    "qwen3_5_moe": _qwen_like(),
    "lfm3_vl": _qwen_like(),
    "lfm2_vl": (Modality("image", "image_token_id", "pixel_values", "spatial_shapes", ("pixel_attention_mask",),
                         _one_each, _downsampled, "pixel_attention_mask"),),
    "nemotron_h_omni": (Modality("image", "image_token_id", "pixel_values", "image_grid_hw", (), _products,
                                 _quartered),),
    "inkling_mm_model": (Modality("image", "image_token_id", "pixel_values"),),
    "inkling2": (Modality("image", "image_token_id", "pixel_values", "image_grid_thw", (), _products, _products),),
    "inkling2_loop": (Modality("image", "image_token_id", "pixel_values", "image_grid_thw", (), _products, _products),),
}

#: Inputs of a wrapper that the cache does not key blocks by: a call holding one runs without reuse (its
#: placeholders would share token ids across different content). Nemotron-H Omni's videos reuse the image token
#: and have no grid; audio runs through its own tower.
UNKEYED_INPUTS: dict[str, tuple[str, ...]] = {
    "nemotron_h_omni": ("pixel_values_videos", "input_features"),
    "inkling_mm_model": ("audio_input_ids",),
}


def modalities_of(model: torch.nn.Module) -> tuple[Modality, ...]:
    """The modalities of ``model`` if it is a served wrapper, else ``()``."""
    return WRAPPERS.get(getattr(model.config, "model_type", None), ())


def placeholder_ids(model: torch.nn.Module) -> frozenset[int]:
    """Token ids that stand for content outside the token ids in ``model``'s prompts (images, videos, audio): a
    forward that feeds one without the content's key is not stored."""
    config = model.config
    names = {m.token_id for m in modalities_of(model)} | ({"audio_token_id"} if modalities_of(model) else set())
    ids = (getattr(config, name, None) for name in names)
    return frozenset(i for i in ids if isinstance(i, int))
