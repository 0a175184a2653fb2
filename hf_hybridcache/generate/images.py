"""A ``generate()`` call of a vision-language wrapper with images in its prompt (:mod:`hf_hybridcache.multimodal`).

1. Where ``generate()`` would encode every image before its prefill, :func:`defer_images` takes the pixel inputs out
   of its kwargs instead and cuts them into items (:class:`~hf_hybridcache.multimodal.ImagePrompt`).
2. :func:`~hf_hybridcache.generate.lifecycle.begin_request` looks the prompt up by its token keys (each image's
   content in place of its placeholder ids), so only a prefix with the same images hits.
3. :func:`encode_images` encodes the images that reach into the uncached tail and hands the model the feature rows
   of the tail's placeholders; an image inside the restored prefix is never encoded.

A call the keys cannot serve runs as transformers runs it, with nothing looked up or stored: several rows (a batch,
beams, ``num_return_sequences``), padding, precomputed ``mm_encoder_outputs``, and inputs the keys do not cover
(:data:`~hf_hybridcache.multimodal.UNKEYED_INPUTS`: audio, Nemotron-H Omni's videos).

Positions need nothing more. Qwen3.5's 3D rotary positions and ``rope_deltas`` are computed by ``generate()`` from the
whole prompt before the request begins (:meth:`~hf_hybridcache.generate.live_cache.LiveCache.get_seq_length` is 0
then, as a fresh cache's), and the tail's forward gets the tail of those positions, as a cold run's would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..multimodal import UNKEYED_INPUTS, ImagePrompt, ImageReport, modalities_of


@dataclass
class CallImages:
    """The images of one ``generate()`` call.

    Attributes:
        prompt: the prompt's items, when they are encoded after the restore (None: transformers encodes them).
        uncached: why nothing of the call is looked up or stored (a key of
            :data:`~hf_hybridcache.core.explain.NOT_CACHEABLE`), or None.
    """

    prompt: ImagePrompt | None = None
    uncached: str | None = None


def defer_images(
    model, input_ids: torch.Tensor, model_kwargs: dict, generation_config
) -> tuple[CallImages | None, bool]:
    """Take the images out of ``model_kwargs`` when the call can reuse prefixes with them (see the module docstring);
    returns the call's images (None: it has none) and whether ``generate()`` must encode them itself."""
    modalities = modalities_of(model)
    present = [m for m in modalities if model_kwargs.get(m.pixels) is not None]
    unkeyed = [name for name in UNKEYED_INPUTS.get(model.config.model_type, ()) if model_kwargs.get(name) is not None]
    if not present and not unkeyed:
        return None, True
    expand = max(getattr(generation_config, name, 1) or 1 for name in ("num_beams", "num_return_sequences"))
    mask = model_kwargs.get("attention_mask")
    if unkeyed or model_kwargs.get("mm_encoder_outputs"):
        return CallImages(uncached="unkeyed_inputs"), True
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or expand != 1:
        return CallImages(uncached="images_batch"), True
    if mask is not None and not bool((mask == 1).all()):
        return CallImages(uncached="padding"), True
    prompt = ImagePrompt.build(model, input_ids, model_kwargs)
    if prompt is None:
        return None, True  # placeholders and pixel inputs disagree: the model's own check says so
    for name in prompt.inputs:
        model_kwargs.pop(name, None)
    return CallImages(prompt), False


def prompt_keys(images: CallImages | None, input_ids: torch.Tensor) -> torch.Tensor:
    """The token keys ``[1, T]`` a request with ``images`` is looked up and stored by (its ids without images)."""
    if images is None or images.prompt is None:
        return input_ids
    return images.prompt.keys(input_ids)


def encode_images(cache, images: CallImages, model_kwargs: dict) -> None:
    """Put the features of the images the request's restored prefix leaves in its tail into ``model_kwargs``
    (``mm_encoder_outputs``) and record what was encoded and skipped (``cache.last_images``, the core's counters)."""
    if images.prompt is None:
        cache.live.images = ImageReport()
        return
    hit_tokens = cache.last_hit_tokens[0] if cache.last_hit_tokens else 0
    outputs = images.prompt.encode(hit_tokens)
    if outputs:
        model_kwargs["mm_encoder_outputs"] = outputs
    report = cache.live.images = images.prompt.report
    with cache.core.store_lock:
        counters = cache.core.counters
        for name, value in (("images_encoded", report.encoded), ("images_skipped", report.skipped),
                            ("vision_encoder_calls", report.encoder_calls),
                            ("vision_encoder_seconds", report.encoder_seconds)):
            counters[name] = counters.get(name, 0) + value
