"""Deterministic mode (issue 46): which models it accepts, what it refuses and why, and what it installs.

``HybridPrefixCache(model, deterministic=True)`` calls :func:`check` before anything is patched and :func:`install`
after the family's own patches (:mod:`.paths`). The mode is accepted only where every op of the model's forward has a
row-invariant, path-invariant form here (docs/deterministic.md, "The ingredients"): today the pure Mamba-1 families
(Mamba, Falcon-Mamba: embeddings, RMSNorms, the mixer of :mod:`.mamba1_deterministic`, the LM head), the pure Mamba-2
one (the mixer of :mod:`.mamba2_deterministic`), the Mamba-2 hybrids Bamba, GraniteMoeHybrid, Nemotron-H and Zamba2 (the
same mixer: theirs is upstream Zamba2's plain one; attention and MLPs of :mod:`.hybrid_deterministic`; routed experts of
:mod:`.moe_deterministic`), Jamba (its Mamba-1 mixers, and the attention, MLPs and routed experts of
:mod:`.hybrid_deterministic`), Qwen3.5's text models, dense and MoE, Qwen3-Next, OLMo-Hybrid and Lara Mini (the gated
delta net mixer of :mod:`.gated_delta_deterministic`, the gated, plain, sliding-window or position-free attention, MLPs
and routed + shared experts of :mod:`.hybrid_deterministic`), LFM2 / LFM2-MoE (the short conv mixer of
:mod:`.short_conv_deterministic`, the attention with q/k RMSNorms, SwiGLU MLPs and sigmoid-routed experts of
:mod:`.hybrid_deterministic`; LFM3 the same mixer, its attention also sliding-window with a sigmoid gate per head),
Inkling's text model with dense MLPs (the four short convolutions and the attention with relative logits of
:mod:`.inkling_deterministic`), Inkling 2's and Inkling 2 Loop's (the static and dynamic short convolutions, l2
clips, relative bias, output gate, softcaps, block attention residuals and message gates of
:mod:`.inkling2_deterministic`, the sink logits in the invariant attention, the experts of :mod:`.moe_deterministic`),
Kimi Linear / Ling (the KDA mixer and Ling's gated MLA attention of
:mod:`.kda_deterministic`, the MLA attention, MLPs and grouped-router experts of :mod:`.hybrid_deterministic`), and
Falcon-H1 (the Mamba-2 mixer with its multipliers and gate, :mod:`.falcon_h1_deterministic`, beside attention in every
layer) and ZAYA (its CCA projection and router GELU of :mod:`.zaya_deterministic`, its full and sliding-window
attention and routed experts of :mod:`.hybrid_deterministic`), on CPU, in float32, bfloat16 and float16. Every other
family is refused with the ingredients it lacks named, and so is a model whose kernels or BLAS would break the
guarantee: refusing, never warning and continuing, is the point of the mode (vLLM's batch-invariant mode likewise
fails closed on layers it has no kernel for).
"""

from __future__ import annotations

import torch

from .. import _compat
from .._compat.hub_kernels import kernels_from_hub
from ..config import ModelStateSpec
from ..kernels.attention_invariant import check_invariance as check_attention_invariance
from ..kernels.batch_invariant import check_row_invariance, check_thread_invariance
from ..kernels.decode_linear import weight_qualifies
from . import (
    falcon_h1_deterministic,
    gated_delta_deterministic,
    hybrid_deterministic,
    inkling2_deterministic,
    inkling_deterministic,
    kda_deterministic,
    mamba1_deterministic,
    mamba2_deterministic,
    short_conv_deterministic,
    zamba_deterministic,
    zaya_deterministic,
)
from .mamba1 import DETERMINISTIC_FORWARD
from .wrappers import decoder_model_type

#: model_type -> (the mixer class, or a tuple of them, the module whose ``deterministic_forward`` stands in for its forward and whose
#: ``lm_head_forward`` for the LM head's). A hybrid's other layers are :mod:`.hybrid_deterministic`'s ``FAMILIES``.
SUPPORTED = {
    "mamba": ("MambaMixer", mamba1_deterministic),
    "falcon_mamba": ("FalconMambaMixer", mamba1_deterministic),
    "mamba2": ("Mamba2Mixer", mamba2_deterministic),
    "bamba": ("BambaMixer", mamba2_deterministic),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer", mamba2_deterministic),
    "nemotron_h": ("NemotronHMamba2Mixer", mamba2_deterministic),
    "zamba2": ("Zamba2MambaMixer", mamba2_deterministic),
    "falcon_h1": ("FalconH1Mixer", falcon_h1_deterministic),
    "jamba": ("JambaMambaMixer", mamba1_deterministic),
    "zamba": ("ZambaMambaMixer", zamba_deterministic),
    "qwen3_5_text": ("Qwen3_5GatedDeltaNet", gated_delta_deterministic),
    "qwen3_5_moe_text": ("Qwen3_5MoeGatedDeltaNet", gated_delta_deterministic),
    "qwen3_next": ("Qwen3NextGatedDeltaNet", gated_delta_deterministic),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet", gated_delta_deterministic),
    "lara_mini": ("LaraMiniGatedDeltaNet", gated_delta_deterministic),
    "lfm2": ("Lfm2ShortConv", short_conv_deterministic),
    "lfm2_moe": ("Lfm2MoeShortConv", short_conv_deterministic),
    "lfm3": ("Lfm3ShortConv", short_conv_deterministic),
    "inkling_text": ("InklingShortConvolution", inkling_deterministic),
    "inkling2_text": (inkling2_deterministic.MIXERS, inkling2_deterministic),
    "inkling2_loop_text": (inkling2_deterministic.LOOP_MIXERS, inkling2_deterministic),
    "kimi_linear": ("KimiLinearDeltaAttention", kda_deterministic),
    "bailing_hybrid": ("BailingHybridDeltaAttention", kda_deterministic),
    "zaya": ("ZayaCCAProjection", zaya_deterministic),
}
#: The dtypes the mode's tests hold in.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Set on a model once a cache was built for it: True in deterministic mode. A model serves one mode for its life.
MODE_ATTR = "_hf_hybridcache_deterministic"

_ATTENTION = "its attention layers wired to the attention with a fixed reduction order " \
             "(kernels/attention_invariant.py, as Jamba's are)"
_ACTIVATIONS = "its MLPs wired to the row-invariant linear and SiLU (F.silu gives an element other float32 bits by " \
               "its offset; models/hybrid_deterministic.py, as Jamba's are)"


def missing_ingredients(model: torch.nn.Module, spec: ModelStateSpec) -> list[str]:
    """The ingredients deterministic mode lacks for ``model`` (its decoder's ``model_type``; ``spec`` says whether it
    has attention layers); empty for the families of :data:`SUPPORTED`."""
    model_type = decoder_model_type(model.config)
    if model_type in SUPPORTED:
        return []
    missing = [f"a deterministic path for model_type={model_type!r}"]  # a family registered after this table
    return missing + ([_ATTENTION, _ACTIVATIONS] if spec.attention else [])


def check(model: torch.nn.Module, spec: ModelStateSpec) -> None:
    """Refuse ``model`` for deterministic mode unless every ingredient is in place and measured to hold here.

    Probes each distinct linear weight shape and dtype with
    :func:`~hf_hybridcache.kernels.batch_invariant.check_row_invariance` and, for the products an engine decode step
    runs on one thread, :func:`~hf_hybridcache.kernels.batch_invariant.check_thread_invariance` (once per process; a
    few products of up to 256 rows).

    Raises:
        ValueError: the family lacks ingredients (named, with what to do); its mixers' conv runs an activation other
            than SiLU (the invariant conv has SiLU only); a Hub kernel library is swapped in;
            a parameter is off the CPU or of a dtype other than float32 / bfloat16 / float16; this BLAS sums a
            linear layer's row differently at some row count or on one thread; the invariant attention gives a
            query other bits in a decode step or a prefill chunk here (a hybrid's probe).
    """
    name = type(model).__name__
    missing = missing_ingredients(model, spec)
    if missing:
        raise ValueError(
            f"deterministic=True is not available for {name} yet: it needs {'; '.join(missing)}. Build the cache "
            "with deterministic=False (the default: tokens equal a cold run, logits within round-off); "
            f"deterministic mode supports {', '.join(sorted(SUPPORTED))} (docs/deterministic.md)."
        )
    swapped = kernels_from_hub(model)
    if swapped:
        raise ValueError(f"deterministic=True refuses {name}: Hub kernels are swapped in ({', '.join(swapped)}), "
                         "whose reduction order is not checked. Load it with use_kernels=False or call "
                         "model.reset_kernels(), or build the cache with deterministic=False.")
    for param_name, param in model.named_parameters():
        if param.device.type != "cpu" or param.dtype not in DTYPES:
            raise ValueError(f"deterministic=True holds on CPU in float32, bfloat16 and float16 only; {name}'s "
                             f"{param_name} is {param.dtype} on {param.device}. Move the model to the CPU in one of "
                             "those dtypes, or build the cache with deterministic=False.")
    model_type = decoder_model_type(model.config)
    products = [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model_type in hybrid_deterministic.FAMILIES:
        problems = hybrid_deterministic.refusals(model, model_type)
        if problems:
            raise ValueError(f"deterministic=True refuses {name}: {'; '.join(problems)}. Build the cache with "
                             "deterministic=False.")
        products += [(weight, None) for weight in hybrid_deterministic.product_weights(model, model_type)]
        try:
            check_attention_invariance(model.get_input_embeddings().weight.dtype)
            window = getattr(model.config.get_text_config(), "sliding_window", None)
            if window is not None:  # a family of hybrid_deterministic.WINDOWED (refusals let no other through)
                check_attention_invariance(model.get_input_embeddings().weight.dtype, window)
        except RuntimeError as error:
            raise ValueError(f"deterministic=True refuses {name} here: {error} Build the cache with "
                             "deterministic=False.") from error
    mixer_classes = _classes(SUPPORTED[model_type][0])
    activations = sorted({a for m in model.modules() if type(m).__name__ in mixer_classes
                          and isinstance(a := getattr(m, "activation", None), str) and a not in ("silu", "swish")})
    if activations:
        raise ValueError(f"deterministic=True refuses {name}: its mixers' conv runs {', '.join(map(repr, activations))}"
                         ", and the invariant conv has an invariant SiLU only (kernels/conv_invariant.py). Build the "
                         "cache with deterministic=False.")
    for weight, bias in products:
        try:
            check_row_invariance(weight, bias)
            if not weight_qualifies(tuple(weight.shape)):  # run on one thread in an engine decode step
                check_thread_invariance(weight, bias)
        except RuntimeError as error:
            raise ValueError(f"deterministic=True refuses {name} here: {error} Build the cache with "
                             "deterministic=False.") from error


def check_served_mode(model: torch.nn.Module, deterministic: bool) -> None:
    """Raise unless ``model`` serves no cache yet or serves ``deterministic``'s mode.

    Raises:
        ValueError: it serves the other mode (its forward patches are that mode's).
    """
    served = getattr(model, MODE_ATTR, None)
    if served is not None and served != deterministic:
        raise ValueError(
            f"This {type(model).__name__} instance already serves a cache with deterministic={served}; one model "
            f"instance runs one mode. Load another instance (from_pretrained again; a copy.deepcopy of this one "
            f"carries its mode) for deterministic={deterministic}."
        )


def serves_deterministic(model: torch.nn.Module) -> bool:
    """Whether ``model`` serves a cache in deterministic mode (False before any cache was built for it)."""
    return bool(getattr(model, MODE_ATTR, False))


def claim(model: torch.nn.Module, deterministic: bool) -> None:
    """Record the mode ``model`` serves (called once a cache is being built for it).

    Raises:
        ValueError: the model already serves the other mode (its patches are installed for that one).
    """
    check_served_mode(model, deterministic)
    setattr(model, MODE_ATTR, deterministic)


def install(model: torch.nn.Module) -> None:
    """Route ``model``'s mixers (already patched by their family) through their family's ``deterministic_forward``
    (:data:`SUPPORTED`) inside this package's caches, its LM head through the row-invariant linear everywhere, and a
    hybrid's other layers (attention, MLPs, experts) through :mod:`.hybrid_deterministic` (idempotent). Call after
    :func:`check`."""
    model_type = decoder_model_type(model.config)
    mixer_classes, forwards = SUPPORTED[model_type]
    for module in model.modules():
        if type(module).__name__ in _classes(mixer_classes):
            setattr(module, DETERMINISTIC_FORWARD, forwards.deterministic_forward)
    _compat.patch_instance_forward(model.get_output_embeddings(), forwards.lm_head_forward)
    if model_type in hybrid_deterministic.FAMILIES:
        hybrid_deterministic.install(model, model_type)


def _classes(names: str | tuple[str, ...]) -> tuple[str, ...]:
    """A :data:`SUPPORTED` mixer entry as a tuple of class names."""
    return (names,) if isinstance(names, str) else names
