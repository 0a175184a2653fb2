"""Images in the prompt of a vision-language wrapper (Qwen3.5, LFM2-VL, LFM3-VL, Nemotron-H Omni, Inkling): where
each image's placeholder tokens are, the token keys that put its content into the block hashes, and the encoding of
only the images a hit leaves in the tail.

Modules: ``wrappers`` (the wrappers served and how each keeps its images), ``prompt`` (one prompt's items, keys and
encoding). The life of a ``generate()`` call with images is :mod:`hf_hybridcache.generate.images`.
"""

from .prompt import ImagePrompt, ImageReport, Item, key_placeholders
from .wrappers import UNKEYED_INPUTS, WRAPPERS, Modality, modalities_of, placeholder_ids

__all__ = [
    "UNKEYED_INPUTS",
    "WRAPPERS",
    "ImagePrompt",
    "ImageReport",
    "Item",
    "Modality",
    "key_placeholders",
    "modalities_of",
    "placeholder_ids",
]
