"""The pure state-space models: Mamba (``MambaMixer``), Falcon-Mamba (``FalconMambaMixer``) and Mamba-2
(``Mamba2Mixer``). Every layer is a mixer and none attends (Gu & Dao 2023, "Mamba"; Dao & Gu 2024, "Transformers are
SSMs"; Zuo et al. 2024, "Falcon Mamba"), so a stored block holds no KV: it is a link of the hash chain (its token ids),
and a hit needs only the checkpoint at its end. These are the models vLLM's prefix caching for Mamba layers was first
built for (its block-boundary checkpoints, from ``initial_states`` / ``return_final_states``).

Mamba and Falcon-Mamba have transformers' Mamba-1 mixer, whose multi-token forward starts from a zero state even over
a cache that holds one (transformers 5.23 - 5.25: 5.25's ``mamba_scan_forward`` says so in a TODO): the patched mixer
is Jamba's (:func:`.jamba.forward_from_state`, the same code upstream, Mamba's without the dt/B/C norms), which
continues from the cached state and emits the checkpoints. Mamba-2's mixer continues from a cached state upstream and
is the plain Mamba-2 mixer of :mod:`.mamba2` (its forward is ``Zamba2MambaMixer``'s line for line in 5.23.0).

Upstream: ``transformers/models/mamba/modeling_mamba.py``, ``models/falcon_mamba/modeling_falcon_mamba.py``,
``models/mamba2/modeling_mamba2.py`` (5.23.0 - 5.25.0). Their decoder layers are ``model.backbone.layers``, each with
its mixer as ``.mixer``; cache layer ``i`` is layer ``i``'s.
"""

from __future__ import annotations

import functools

import torch

from .. import _compat
from ..config import MambaLayerSpec, ModelStateSpec, TensorSpec
from .base import ModelSupport
from .jamba import decode_step, forward_from_state
from .mamba1 import KERNELS, patch_mixers
from .mamba2 import Mamba2Variant, mamba2_support


def _mamba1_install(model: torch.nn.Module, mixer_class: str) -> None:
    patch_mixers(model, mixer_class, forward_from_state, decode_step)


def _mamba1_state_spec(model: torch.nn.Module, block_size: int) -> ModelStateSpec:
    """One Mamba-1 state per layer: conv state ``[I, W]`` in the model dtype, SSM state ``[I, N]`` in float32 (the
    scan and the decode step keep it in float32 in every dtype, as Jamba's)."""
    mamba = []
    for idx, layer in enumerate(_compat.decoder_layers(model)):
        mixer = layer.mixer
        mamba.append(
            MambaLayerSpec(
                idx,
                conv=TensorSpec((mixer.intermediate_size, mixer.conv_kernel_size), mixer.in_proj.weight.dtype),
                ssm=TensorSpec((mixer.intermediate_size, mixer.ssm_state_size), torch.float32),
            )
        )
    return ModelStateSpec((), tuple(mamba), block_size)


def _mamba1_support(model_type: str, mixer_class: str) -> ModelSupport:
    return ModelSupport(
        model_types=(model_type,),
        install=functools.partial(_mamba1_install, mixer_class=mixer_class),
        state_spec=_mamba1_state_spec,
        **KERNELS,
    )


MAMBA = _mamba1_support("mamba", "MambaMixer")
FALCON_MAMBA = _mamba1_support("falcon_mamba", "FalconMambaMixer")
MAMBA2 = mamba2_support(("mamba2",), Mamba2Variant("Mamba2Mixer", attention_class=None))
