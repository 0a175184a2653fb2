"""Registry ``model_type -> support module``. Adding a family is one file with a ``SUPPORT`` object."""

from __future__ import annotations

from .bamba import SUPPORT as _BAMBA
from .base import ModelSupport
from .falcon_h1 import SUPPORT as _FALCON_H1
from .granitemoehybrid import SUPPORT as _GRANITEMOEHYBRID
from .inkling import INKLING2 as _INKLING2
from .inkling import INKLING2_LOOP as _INKLING2_LOOP
from .inkling import SUPPORT as _INKLING
from .jamba import SUPPORT as _JAMBA
from .kimi_delta import BAILING_HYBRID as _BAILING_HYBRID
from .kimi_delta import KIMI_LINEAR as _KIMI_LINEAR
from .lara_mini import SUPPORT as _LARA_MINI
from .mamba import FALCON_MAMBA as _FALCON_MAMBA
from .mamba import MAMBA as _MAMBA
from .mamba import MAMBA2 as _MAMBA2
from .nemotron_h import SUPPORT as _NEMOTRON_H
from .olmo_hybrid import SUPPORT as _OLMO_HYBRID
from .qwen3_5 import MOE_SUPPORT as _QWEN3_5_MOE
from .qwen3_5 import SUPPORT as _QWEN3_5
from .qwen3_next import SUPPORT as _QWEN3_NEXT
from .refused import REFUSED
from .short_conv import LFM2 as _LFM2
from .short_conv import LFM2_MOE as _LFM2_MOE
from .short_conv import LFM3 as _LFM3
from .wrappers import decoder_model_type
from .zamba import SUPPORT as _ZAMBA
from .zamba2 import SUPPORT as _ZAMBA2
from .zaya import SUPPORT as _ZAYA

_REGISTRY: dict[str, ModelSupport] = {}


def register(support: ModelSupport) -> None:
    for model_type in support.model_types:
        _REGISTRY[model_type] = support


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def support_for(model) -> ModelSupport:
    """The support module for ``model``.

    Raises:
        ValueError: the model is not a supported hybrid model (the message lists the supported families), or is a
            hybrid this package refuses (the message says why and, where there is one, what to load instead).
    """
    config = getattr(model, "config", None)
    return support_for_config(config, type(model).__name__, can_generate=hasattr(model, "generate"))


def support_for_config(config, model_name: str | None = None, can_generate: bool = True) -> ModelSupport:
    """The support module for a model of ``config``, known before its weights load (the server reads a checkpoint's
    ``config.json`` first). ``model_name`` names the model in errors (default: the config's first architecture).

    Raises:
        ValueError: as :func:`support_for`.
    """
    model_type = getattr(config, "model_type", None)
    name = model_name or next(iter(getattr(config, "architectures", None) or []), type(config).__name__)
    support = _REGISTRY.get(decoder_model_type(config)) if config is not None else None
    if model_type in REFUSED:
        raise ValueError(f"HybridPrefixCache does not support {name}: model_type={model_type!r} {REFUSED[model_type]}")
    if support is None or not can_generate:
        raise ValueError(
            f"HybridPrefixCache does not support {name} (model_type={model_type!r}). Supported "
            f"families: {', '.join(supported_model_types())}; pass their *ForCausalLM model, or the vision-language "
            "wrapper of one (Qwen3.5, LFM2-VL, LFM3-VL, Nemotron-H Omni, Inkling)."
        )
    return support


register(_JAMBA)
register(_ZAMBA)
register(_ZAMBA2)
register(_FALCON_H1)
register(_BAMBA)
register(_GRANITEMOEHYBRID)
register(_NEMOTRON_H)
register(_QWEN3_NEXT)
register(_QWEN3_5)
register(_QWEN3_5_MOE)
register(_LFM2)
register(_LFM2_MOE)
register(_LFM3)
register(_OLMO_HYBRID)
register(_KIMI_LINEAR)
register(_BAILING_HYBRID)
register(_INKLING)
register(_INKLING2)
register(_INKLING2_LOOP)
register(_ZAYA)
register(_LARA_MINI)
register(_MAMBA)
register(_FALCON_MAMBA)
register(_MAMBA2)
