"""Hybrid families transformers has that HybridPrefixCache refuses, each with the reason it gives the user.

A refusal is a ``ValueError`` raised when the cache is built, before anything is patched, so the model and any other
cache stay as they were.
"""

from __future__ import annotations

from packaging.version import Version

from .._compat import TRANSFORMERS_VERSION

#: model_type -> why it is refused.
REFUSED: dict[str, str] = {
    "glm5_next": (
        "has no text-only *ForCausalLM in transformers, and its indexed sparse attention picks a different top-k "
        "when a prompt continues from a cache than in one forward, so a cached run cannot equal a cold one."
    ),
    "qwen4_exp": "keeps indexed (sparse top-k) attention layers and token-id n-gram states, which are not stored yet.",
    "qwen4_exp_text": "keeps indexed (sparse top-k) attention layers and token-id n-gram states, which are not stored yet.",
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
