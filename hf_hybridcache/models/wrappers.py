"""Vision-language wrappers whose language model is a supported family: the cache serves that decoder inside the
wrapper (its layers are the wrapper's ``model.language_model.layers``, or ``language_model.model.layers`` for
Nemotron-H Omni, whose language model is a whole ``*ForCausalLM``), with the family's own patched mixers and state
spec. What the wrapper adds, images in the prompt, is :mod:`hf_hybridcache.multimodal`.

Granite 4 Vision (``granite4_vision``) is not among them: its decoder (``granite4_vision_text``) is attention only.
"""

from __future__ import annotations

#: ``model_type`` of the wrappers served; the family of each is its text config's ``model_type``.
VISION_WRAPPERS = ("qwen3_5", "qwen3_5_moe", "lfm2_vl", "lfm3_vl", "nemotron_h_omni", "inkling_mm_model", "inkling2",
                   "inkling2_loop")


def decoder_model_type(config) -> str:
    """The ``model_type`` of the family a wrapper's (or a text model's) decoder belongs to."""
    if getattr(config, "model_type", None) in VISION_WRAPPERS:
        return config.get_text_config(decoder=True).model_type
    return getattr(config, "model_type", None)
