"""Hybrid families transformers has that HybridPrefixCache refuses, each with the reason it gives the user.

A refusal is a ``ValueError`` raised when the cache is built, before anything is patched, so the model and any other
cache stay as they were.
"""

from __future__ import annotations

from packaging.version import Version

from .._compat import TRANSFORMERS_VERSION

_TEXT_DECODER = (
    "is a multimodal wrapper; HybridPrefixCache serves its text decoder: load the checkpoint with "
    "AutoModelForCausalLM.from_pretrained(path), which builds the text-only {text} model."
)
_NO_TEXT_LOADER = (
    "is a multimodal wrapper, and transformers maps no text-only loader to it (AutoModelForCausalLM does not know "
    "its model_type); HybridPrefixCache serves its text decoder {text}: build that model from the checkpoint's "
    "text_config and language-model weights."
)

#: model_type -> why it is refused.
REFUSED: dict[str, str] = {
    "qwen3_5": _TEXT_DECODER.format(text="Qwen3_5ForCausalLM (model_type 'qwen3_5_text')"),
    "qwen3_5_moe": _TEXT_DECODER.format(text="Qwen3_5MoeForCausalLM (model_type 'qwen3_5_moe_text')"),
    "lfm2_vl": (
        "is a multimodal wrapper of an LFM2 decoder, and transformers has no text-only loader for its checkpoints; "
        "load an LFM2 text checkpoint with AutoModelForCausalLM instead."
    ),
    "glm5_next": (
        "has no text-only *ForCausalLM in transformers, and its indexed sparse attention picks a different top-k "
        "when a prompt continues from a cache than in one forward, so a cached run cannot equal a cold one."
    ),
    "qwen4_exp": "keeps indexed (sparse top-k) attention layers and token-id n-gram states, which are not stored yet.",
    "qwen4_exp_text": "keeps indexed (sparse top-k) attention layers and token-id n-gram states, which are not stored yet.",
    "inkling_mm_model": _NO_TEXT_LOADER.format(text="InklingForCausalLM (model_type 'inkling_text')"),
    "inkling2": _NO_TEXT_LOADER.format(text="Inkling2ForCausalLM (model_type 'inkling2_text')"),
    "minimax": (
        "refuses every cache but its own MiniMaxCache (modeling_minimax.py checks the type), and its lightning "
        "attention keeps its state through MiniMaxCache-only methods, not the cache layers a HybridPrefixCache holds."
    ),
    "recurrent_gemma": (
        "keeps its recurrent and conv states on the model's modules, not in the cache, and transformers restarts its "
        "conv from zeros on every multi-token forward, so no prefix state can be restored into it."
    ),
}

#: model_type -> (the first transformers version it is refused on, why): families whose modeling code changed in a
#: way the cache does not read yet.
REFUSED_FROM_VERSION: dict[str, tuple[str, str]] = {}
for _model_type, (_version, _why) in REFUSED_FROM_VERSION.items():
    if Version(TRANSFORMERS_VERSION) >= Version(_version):
        REFUSED[_model_type] = _why
