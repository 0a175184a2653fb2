"""The layers a hybrid adds to its mixers in deterministic mode (issue 46; Jamba, Zamba, Qwen3.5, Bamba, Granite-4.0-H,
Nemotron-H, Zamba2, LFM2, LFM3, Inkling, Inkling 2 and its Loop, OLMo-Hybrid, Lara Mini, Kimi Linear, Ling, Falcon-H1,
ZAYA): attention, MLP activations, linear layers and routed experts, each with a row-invariant, path-invariant form
(docs/deterministic.md, "The ingredients").

- Every ``torch.nn.Linear`` (attention projections, MLPs, the LM head) runs through
  :func:`~hf_hybridcache.models.mamba1_deterministic.lm_head_forward` (the row-invariant linear).
- The attention modules of :data:`FAMILIES` answer through
  :func:`~hf_hybridcache._compat.invariant_attention.invariant_attention_forward` (keys summed in fixed blocks
  anchored at position 0, whatever the call), in ``generate()`` and in the engine's steps alike. A sliding-window
  layer (Lara Mini's, LFM3's, Inkling's: :data:`WINDOWED`) passes its window, which the kernel anchors at each query
  instead (its bits do not depend on how many keys the cache holds beyond the window); OLMo-Hybrid's and Lara Mini's attention forwards
  (q/k RMSNorms, rotary or none: Lara Mini's full layers and a ``rope_theta=None`` OLMo-Hybrid are position-free)
  run as upstream around that call.
- The MLP activations (``SiLUActivation`` / ``nn.SiLU`` modules, and the ``F.silu`` of LFM2's ``Lfm2MLP``, whose
  forward :func:`swiglu_forward` replaces) run as
  :func:`~hf_hybridcache.kernels.mamba1_invariant.silu_invariant` in float32, rounded once to the input dtype:
  ``F.silu`` gives an element other float32 bits by its offset in the tensor (its vectorized body and scalar tail
  differ; ``benchmarks/batch_invariance.py``, table 2b), so a token's MLP output moved with the number of tokens
  beside it. ``GELUActivation`` (Zamba's, the erf form) runs ``F.gelu`` in float32, rounded once: float32's is
  offset-invariant here, float16's is not. ``ReLUSquaredActivation`` (Nemotron-H's ``relu2``) runs as upstream: relu is
  exact and its square one correctly rounded product, the same bits at any offset in every dtype (measured).
- LFM3's attention (``Lfm3Attention``) runs
  :func:`~hf_hybridcache.models.short_conv_deterministic.head_gated_forward` (its window and head gate there).
- Inkling's attention (``InklingAttention``) runs
  :func:`~hf_hybridcache.models.inkling_deterministic.attention_forward` (its relative bias handed to the invariant
  attention), its MLP activations as above; its routed experts (``InklingMoE``) run
  :func:`~hf_hybridcache.models.moe_deterministic.inkling_moe_forward`.
- A gated attention module (Qwen3.5's ``Qwen3_5Attention``, transformers 5.23 - 5.25) runs
  :func:`gated_attention_forward`: upstream's forward with its output gate ``sigmoid(gate)`` taken as
  :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant` in float32, rounded once to the gate's
  dtype (``torch.sigmoid`` gives an element other float32 bits by its offset in the tensor); its q/k RMSNorms and
  rotary embedding (``cos`` / ``sin``, measured the same bits at any offset) as upstream.
- A routed + shared experts block (Qwen3.5-MoE's ``Qwen3_5MoeSparseMoeBlock``) runs :func:`shared_moe_forward`: the
  routed experts as below (the top-k weights renormalized, as its router does) plus the shared expert gated by
  ``sigmoid_invariant``.
- Lara Mini's ``LaraMiniSparseMoeBlock`` runs :func:`shared_moe_forward` too: its router's logits a float32 product
  (:data:`FLOAT32_ROUTERS`), its shared expert added without a gate.
- LFM2-MoE's ``Lfm2MoeSparseMoeBlock`` runs :func:`sigmoid_moe_forward`: its router's sigmoid scores from ``exp``, the
  routed experts as below (their ``F.silu`` as the invariant SiLU).
- Kimi Linear's and Ling's ``KimiLinearMoE`` / ``BailingHybridMoE`` run :func:`grouped_moe_forward`: the grouped
  sigmoid router with its correction bias (sigmoid from ``exp``), the routed experts as below (Ling's SwiGLU clipped
  by ``experts.limit``) and the shared experts; Ling's gated MLA attention runs
  :func:`~hf_hybridcache.models.kda_deterministic.gated_mla_forward`.
- A routed-experts block (Jamba's ``JambaSparseMoeBlock``, transformers 5.23 - 5.25) runs :func:`sparse_moe_forward`:
  upstream's router and experts, each expert's products on the rows routed to it through the row-invariant linear, and
  each token's experts summed in the order of its own top-k choice (upstream sums in expert order, also fixed per
  token; the order here needs no scatter).
- Granite-4.0-H's, Nemotron-H's, Inkling's and Inkling 2's experts blocks and ZAYA's experts run
  :mod:`.moe_deterministic`'s forwards (:data:`FORWARDS <.moe_deterministic.FORWARDS>`), Inkling 2's other modules
  :mod:`.inkling2_deterministic`'s; ZAYA's attention (sliding-window layers too, the window handed over by upstream) is
  routed like Jamba's, its router MLP's ``nn.GELU`` runs :func:`~hf_hybridcache.models.zaya_deterministic.gelu_forward`.

The RMSNorms, softmaxes, embeddings and residual adds run as upstream (measured row-invariant here). :data:`_OFF` is
the private switch of the power tests: ``"attention"`` runs the model's own attention function, ``"activation"``
``F.silu`` / the model's GELU, ``"contiguous"`` the float32 GELU on its input's own strides, ``"gate"`` the gated
attention's ``torch.sigmoid`` (and LFM2-MoE's, Kimi Linear's and Ling's routers'), ``"shared_gate"`` the shared
expert's, ``"window"`` a sliding layer's attention in the form anchored at position 0 with the window in the mask only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _compat
from .._compat.invariant_attention import gated_attention_parts, invariant_attention_forward, mark, unroutable
from ..kernels.gated_delta_invariant import sigmoid_invariant
from ..kernels.mamba1_invariant import silu_invariant
from . import inkling2_deterministic as inkling2
from . import inkling_deterministic, kda_deterministic, moe_deterministic, short_conv_deterministic, zaya_deterministic
from .mamba1_deterministic import linear as _linear
from .mamba1_deterministic import lm_head_forward

#: model_type -> (attention module class, routed-experts block class or None): the hybrids whose layers this module
#: knows (their mixers are wired by :mod:`.deterministic`).
FAMILIES = {"jamba": ("JambaAttention", "JambaSparseMoeBlock"), "zamba": ("ZambaAttention", None),
            "qwen3_5_text": ("Qwen3_5Attention", None),
            "qwen3_5_moe_text": ("Qwen3_5MoeAttention", "Qwen3_5MoeSparseMoeBlock"),
            "qwen3_next": ("Qwen3NextAttention", "Qwen3NextSparseMoeBlock"),
            "bamba": ("BambaAttention", None), "granitemoehybrid": ("GraniteMoeHybridAttention", "GraniteMoeHybridMoE"),
            "nemotron_h": ("NemotronHAttention", "NemotronHMoE"), "zamba2": ("Zamba2Attention", None),
            "falcon_h1": ("FalconH1Attention", None),
            "lfm2": ("Lfm2Attention", None), "lfm2_moe": ("Lfm2MoeAttention", "Lfm2MoeSparseMoeBlock"),
            "olmo_hybrid": ("OlmoHybridAttention", None),
            "lara_mini": ("LaraMiniAttention", "LaraMiniSparseMoeBlock"),
            "kimi_linear": ("KimiLinearAttention", "KimiLinearMoE"),
            "bailing_hybrid": ("BailingHybridAttention", "BailingHybridMoE"),
            "lfm3": ("Lfm3Attention", None), "inkling_text": ("InklingAttention", "InklingMoE"),
            "zaya": ("ZayaAttention", "ZayaExperts"),
            **inkling2.FAMILIES}
#: Routed-experts blocks a family may hold that have no deterministic form here yet: a model holding one is refused.
UNWIRED_EXPERTS: dict[str, str] = {}
#: The MLP classes that call ``F.silu`` in their forward (no activation module to patch): :func:`swiglu_forward`.
SWIGLU_MLPS = ("Lfm2MLP", "Lfm2MoeMLP", "Lfm3MLP")
#: The attention classes whose forward gates its output with a sigmoid (:func:`gated_attention_forward`).
GATED_ATTENTION = ("Qwen3_5Attention", "Qwen3_5MoeAttention", "Qwen3NextAttention")
#: The attention classes gated per head by ``sigmoid(g_proj(x))`` after the attention
#: (:func:`~hf_hybridcache.models.short_conv_deterministic.head_gated_forward`).
HEAD_GATED_ATTENTION = ("Lfm3Attention",)
#: The activations with an invariant form here (transformers' ``ACT2FN["silu"]`` / ``ACT2FN["gelu"]`` and torch's).
ACTIVATIONS = ("silu", "swish", "gelu", "relu2")
#: The families whose gated delta net / KDA / Falcon-H1 Mamba-2 conv runs ``hidden_act``, which has an invariant form there for SiLU only.
SILU_CONV = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid", "lara_mini",
             "kimi_linear", "bailing_hybrid", "falcon_h1")
#: The families whose sliding-window attention layers are wired (the invariant attention's windowed form).
WINDOWED = ("lara_mini", "lfm3", "inkling_text", "zaya", *inkling2.FAMILIES)
#: The routers whose logits are a float32 product of float32 copies of the input and weight (Lara Mini's).
FLOAT32_ROUTERS = ("LaraMiniTopKRouter",)
#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def refusals(model: torch.nn.Module, model_type: str) -> list[str]:
    """What keeps ``model``'s layers (of a family in :data:`FAMILIES`) from deterministic mode; empty when none."""
    config = model.config.get_text_config()
    problems = [problem] if (problem := unroutable(model)) is not None else []
    activation = getattr(config, "hidden_act", None) or getattr(config, "mlp_hidden_act", None) or "silu"
    if activation not in ACTIVATIONS:
        problems.append(f"hidden_act={activation!r} (only SiLU, GELU and relu2 have an invariant form here)")
    elif model_type in SILU_CONV and config.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act={config.hidden_act!r} (the mixer's conv, a gated delta net's, KDA's or "
                        "Falcon-H1's Mamba-2, has an invariant SiLU only)")
    if model_type == "zaya" and (gelu := zaya_deterministic.refusal()) is not None:
        problems.append(gelu)
    problems += inkling2.refusals(model_type, config)
    unwired = UNWIRED_EXPERTS.get(model_type)
    if unwired is not None and any(type(m).__name__ == unwired for m in model.modules()):
        problems.append(f"routed experts ({unwired}: no deterministic form of its router and expert sum yet; a "
                        "config without them is accepted)")
    if getattr(model.config, "vision_config", None) is not None:
        problems.append("a vision tower (its attention and merger have no invariant form here; load the text model, "
                        "e.g. Qwen3_5ForCausalLM, for text requests)")
    if getattr(config, "sliding_window", None) is not None and model_type not in WINDOWED:
        problems.append(f"sliding_window={config.sliding_window} (the invariant attention has no window yet)")
    return problems


def product_weights(model: torch.nn.Module, model_type: str) -> list[torch.Tensor]:
    """The weights of the products the mode runs outside ``torch.nn.Linear`` modules, for the row-invariance probes:
    :func:`sparse_moe_forward`'s (the router, one expert's gate-up and down projections per block) and a per-head
    mixer's (one head's ``x_proj_weight`` and ``dt_proj_weight``, Zamba's)."""
    experts_class = FAMILIES[model_type][1]
    weights = []
    if experts_class is None:
        return weights
    for module in model.modules():
        if type(module).__name__ in moe_deterministic.FORWARDS:
            weights += moe_deterministic.product_weights(module)
        elif type(module).__name__ == experts_class:
            router = _router(module).weight
            router = router.float() if (type(_router(module)).__name__ in FLOAT32_ROUTERS
                                      or hasattr(module, "shared_experts")) else router
            weights += [router, module.experts.gate_up_proj[0], module.experts.down_proj[0]]
        if isinstance(getattr(module, "x_proj_weight", None), torch.nn.Parameter):
            weights += [module.x_proj_weight[0], module.dt_proj_weight[0]]
    return weights


def install(model: torch.nn.Module, model_type: str) -> None:
    """Route ``model``'s linear layers, activations, attention and routed experts through their deterministic forms
    (idempotent; after :func:`refusals` came back empty)."""
    attention_class, experts_class = FAMILIES[model_type]
    for module in model.modules():
        name = type(module).__name__
        if isinstance(module, torch.nn.Linear):
            _compat.patch_instance_forward(module, lm_head_forward)
        elif name in ("SiLUActivation", "SiLU"):
            _compat.patch_instance_forward(module, silu_forward)
        elif name == "GELUActivation":  # ACT2FN["gelu"], the erf form
            _compat.patch_instance_forward(module, gelu_forward)
        elif experts_class is not None and name == experts_class:
            moe_forward = moe_deterministic.FORWARDS.get(name) or (
                shared_moe_forward if hasattr(module, "shared_expert") else
                grouped_moe_forward if hasattr(module, "shared_experts") else
                sigmoid_moe_forward if name == "Lfm2MoeSparseMoeBlock" else sparse_moe_forward)
            _compat.patch_instance_forward(module, moe_forward)
        elif name in GATED_ATTENTION:
            _compat.patch_instance_forward(module, gated_attention_forward)
        elif name == "BailingHybridAttention":
            _compat.patch_instance_forward(module, kda_deterministic.gated_mla_forward)
        elif name in HEAD_GATED_ATTENTION:
            _compat.patch_instance_forward(module, short_conv_deterministic.head_gated_forward)
        elif name in inkling_deterministic.ATTENTION:
            _compat.patch_instance_forward(module, inkling_deterministic.attention_forward)
        elif name in SWIGLU_MLPS:
            _compat.patch_instance_forward(module, swiglu_forward)
        elif name == "ZayaRouterMLP":  # its nn.GELU (models/zaya_deterministic.py)
            _compat.patch_instance_forward(module.act_fn, zaya_deterministic.gelu_forward)
    mark(model, [m for m in model.modules() if type(m).__name__ == attention_class], attention_forward)
    inkling2.install(model, attention_forward)  # Inkling 2's modules and its two attention classes


def attention_forward(original, module, query, key, value, attention_mask, *args, **kwargs):
    """An attention module's call (transformers' attention-function convention) through the invariant attention."""
    if "attention" in _OFF:
        return original(module, query, key, value, attention_mask, *args, **kwargs)
    return invariant_attention_forward(module, query, key, value, attention_mask, *args,
                                       window_at_zero="window" in _OFF, **kwargs)


def gated_attention_forward(module: torch.nn.Module, original, hidden_states: torch.Tensor,
                            position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask=None, **kwargs):
    """A gated attention module's ``(output [B, T, hidden], None)`` for ``hidden_states`` ``[B, T, hidden]`` and the
    rotary ``(cos, sin)``: ``Qwen3_5Attention.forward`` (transformers 5.23 - 5.25), its gate through
    :func:`~hf_hybridcache.kernels.gated_delta_invariant.sigmoid_invariant`; the attention call goes through the
    model's attention function, which deterministic mode routes to the invariant attention."""
    cache, kwargs, apply_rotary, attention, update = gated_attention_parts(module, kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query, gate = torch.chunk(module.q_proj(hidden_states).view(*input_shape, -1, module.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = module.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = module.k_norm(module.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    query, key = apply_rotary(query, key, *position_embeddings)
    if cache is not None:
        key, value = update(key, value)
    dropout = module.attention_dropout if module.training else 0.0
    out, _ = attention(module, query, key, value, attention_mask, dropout=dropout, scaling=module.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    gated = torch.sigmoid(gate) if "gate" in _OFF else sigmoid_invariant(gate.float()).to(gate.dtype)
    return module.o_proj(out * gated), None


def silu_forward(module: torch.nn.Module, original, x: torch.Tensor) -> torch.Tensor:
    """``silu(x)`` for ``x`` of any shape and float dtype: computed in float32 as ``x / (1 + exp(-x))`` and rounded
    once to ``x``'s dtype, the same bits for an element wherever it sits in the tensor."""
    if "activation" in _OFF:
        return F.silu(x)
    return silu_invariant(x.float()).to(x.dtype)


def swiglu_forward(module: torch.nn.Module, original, x: torch.Tensor) -> torch.Tensor:
    """LFM2's MLP ``w2(silu(w1(x)) * w3(x))`` ``[..., hidden]`` (``Lfm2MLP.forward``, transformers 5.23 - 5.25), its
    ``F.silu`` as :func:`silu_forward` (its linears are patched to the row-invariant linear)."""
    gate = module.w1(x)
    return module.w2(silu_forward(module, None, gate) * module.w3(x))


def gelu_forward(module: torch.nn.Module, original, x: torch.Tensor) -> torch.Tensor:
    """``gelu(x)`` (erf form) for ``x`` of any shape and float dtype, computed in float32 and rounded once to ``x``'s
    dtype: float32's erf gives an element the same bits wherever it sits, float16's does not (table 2b). Made contiguous
    first: on a strided view (Zamba2's MLP gates a chunk of ``gate_up_proj``'s output) float32 ``F.gelu`` gave a
    decoded row other bits than the same row in a prefill."""
    if "activation" in _OFF:
        return original(x)
    x32 = x.float() if "contiguous" in _OFF else x.float().contiguous()
    return F.gelu(x32).to(x.dtype)


def _router(block: torch.nn.Module) -> torch.nn.Module:
    """A routed-experts block's router (Jamba's ``router``, Qwen3.5-MoE's ``gate``)."""
    return block.router if hasattr(block, "router") else block.gate


def shared_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """A routed + shared experts block's output ``[B, T, hidden]`` (``hidden_states``' dtype) for ``hidden_states``
    ``[B, T, hidden]``: ``Qwen3_5MoeSparseMoeBlock.forward`` / ``Qwen3NextSparseMoeBlock.forward`` (transformers 5.23 -
    5.25): the router's softmax in float32, its top-k renormalized to sum to one (where ``norm_topk_prob``) and
    rounded to the input's dtype, the routed experts as :func:`sparse_moe_forward` sums them, plus the shared expert
    (its linears and SiLU patched) times ``sigmoid(shared_expert_gate(x))`` from ``exp`` (``F.sigmoid`` moves a
    float32 element with its offset). ``LaraMiniSparseMoeBlock.forward`` (5.24 - 5.25) alike, with its router's
    logits a float32 product (:data:`FLOAT32_ROUTERS`) and its shared expert added whole, without a gate."""
    batch, seq_len, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    shared = block.shared_expert(x)
    float32_router = type(block.gate).__name__ in FLOAT32_ROUTERS
    logits = _linear(x.float(), block.gate.weight.float()) if float32_router else _linear(x, block.gate.weight)
    weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), block.gate.top_k, dim=-1)
    if getattr(block.gate, "norm_topk_prob", True):  # Qwen3-Next's config may turn it off; Qwen3.5-MoE's always on
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    routed = _routed_sum(x, block.experts, weights, chosen)
    if not hasattr(block, "shared_expert_gate"):  # Lara Mini's
        return (routed + shared).reshape(batch, seq_len, hidden)
    gate_logit = block.shared_expert_gate(x)
    gate = torch.sigmoid(gate_logit) if "shared_gate" in _OFF else sigmoid_invariant(gate_logit.float()).to(x.dtype)
    return (routed + gate * shared).reshape(batch, seq_len, hidden)


def sparse_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """A routed-experts block's output ``[B, T, hidden]`` (``hidden_states``' dtype) for ``hidden_states``
    ``[B, T, hidden]``: the router's softmax over ``F.linear``'s logits in float32 and its top-k (weights left
    unnormalized, as ``JambaTopKRouter``), then per token ``sum_k w_k expert_k(x)`` in the token's top-k order, each
    expert ``down(act(gate(x)) * up(x))`` on the rows routed to it through the row-invariant linear."""
    batch, seq_len, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    router, experts = block.router, block.experts
    probs = torch.softmax(_linear(x, router.weight), dim=-1, dtype=torch.float)
    weights, chosen = torch.topk(probs, router.top_k, dim=-1)  # [N, k], each token's choices by weight
    return _routed_sum(x, experts, weights.to(x.dtype), chosen).reshape(batch, seq_len, hidden)


def sigmoid_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """LFM2-MoE's routed-experts block ``[B, T, hidden]`` -> ``[B, T, hidden]`` (``Lfm2MoeSparseMoeBlock.forward`` and
    ``Lfm2MoeTopKRouter.forward``, transformers 5.23 - 5.25): the router's sigmoid scores from ``exp`` in float32,
    rounded to the logits' dtype (``torch.sigmoid`` moves a float32 element with its offset), the top-k by score
    (plus ``expert_bias`` where ``use_expert_bias``), renormalized (``norm_topk_prob``) and scaled by
    ``routed_scaling_factor`` as upstream, then the experts as :func:`sparse_moe_forward` sums them."""
    batch, seq_len, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    router = block.gate
    logits = _linear(x, router.weight)
    scores = torch.sigmoid(logits) if "gate" in _OFF else sigmoid_invariant(logits.float()).to(logits.dtype)
    if block.use_expert_bias:
        _, chosen = torch.topk(scores + block.expert_bias, k=router.top_k, dim=-1)
        weights = torch.gather(scores, dim=1, index=chosen).type_as(logits)
    else:
        weights, chosen = torch.topk(scores, k=router.top_k, dim=-1)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    weights = weights * router.routed_scaling_factor
    return _routed_sum(x, block.experts, weights.to(x.dtype), chosen).reshape(batch, seq_len, hidden)


def grouped_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's routed + shared experts block ``[B, T, hidden]`` -> ``[B, T, hidden]`` (``KimiLinearMoE.forward``
    and ``KimiLinearTopkRouter.forward``, transformers 5.23 - 5.25; DeepSeek-V3's router): float32 logits through the
    row-invariant linear, sigmoid scores from ``exp``, the top-k by score plus ``e_score_correction_bias`` within the
    ``topk_group`` best of ``n_group`` groups (a group's score: its two best), the chosen scores renormalized
    (``norm_topk_prob``) and scaled by ``routed_scaling_factor`` in float32, the experts as :func:`sparse_moe_forward`
    sums them (in the token's top-k order by score, where upstream adds in expert order), plus the shared experts."""
    batch, seq_len, hidden = hidden_states.shape
    x = hidden_states.reshape(-1, hidden)
    router = block.gate
    logits = _linear(x.float(), router.weight.float())
    scores = torch.sigmoid(logits) if "gate" in _OFF else sigmoid_invariant(logits)
    choice = scores + router.e_score_correction_bias
    per_group = router.num_experts // router.num_group
    group_scores = choice.view(-1, router.num_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=router.topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
    choice = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    chosen = torch.topk(choice, k=router.top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * router.routed_scaling_factor
    routed = _routed_sum(x, block.experts, weights, chosen).reshape(batch, seq_len, hidden)
    return routed + block.shared_experts(hidden_states)


def _routed_sum(x: torch.Tensor, experts: torch.nn.Module, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k expert_k(x)`` ``[N, hidden]`` per token in its top-k order for ``x`` ``[N, hidden]``, ``weights`` /
    ``chosen`` ``[N, k]`` (:func:`~.moe_deterministic.routed_sum`); each expert's products on the rows routed to it
    through the row-invariant linear."""
    def activation(gate: torch.Tensor) -> torch.Tensor:  # LFM2-MoE's experts call F.silu themselves
        return silu_forward(experts, None, gate) if experts.act_fn is F.silu else experts.act_fn(gate)
    return moe_deterministic.routed_sum(x, weights, chosen, moe_deterministic.gated_expert(experts, activation))
