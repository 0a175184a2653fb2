"""The routed-experts blocks of Granite-4.0-H, Nemotron-H, Inkling, Inkling 2 and ZAYA in deterministic mode (issue
46), and the per-token sum of routed experts every deterministic experts block shares (:func:`routed_sum`).

- Granite-4.0-H's ``GraniteMoeHybridMoE`` (``num_local_experts > 0``) runs :func:`granite_moe_forward`: its router's
  logits through the row-invariant linear, the top-k by logit, the softmax over the k chosen logits from ``exp`` in
  float32 (:func:`softmax_invariant`), each expert ``down(act(gate(x)) * up(x))`` on its rows through the
  row-invariant linear (its SiLU module patched to the invariant SiLU), summed per token in its top-k order; the
  layer adds its shared MLP (patched like any MLP) as upstream.
- Nemotron-H's ``NemotronHMoE`` (``"moe"`` layers) runs :func:`nemotron_moe_forward`: the DeepSeek-V3-like router
  (logits in float32 through the row-invariant linear, sigmoid scores from ``exp``, ``e_score_correction_bias`` added
  for the choice only, the best ``topk_group`` of ``n_group`` groups by the sum of each group's two best scores, the
  top-k inside them, the chosen scores renormalized by their sum in top-k order where ``norm_topk_prob`` and scaled by
  ``routed_scaling_factor``), the optional latent projections, each expert ``down(relu2(up(x)))`` (no gate) through
  the row-invariant linear, summed per token in its top-k order, plus the shared experts' MLP.
- Inkling's ``InklingMoE`` (``"sparse"`` MLP layers) runs :func:`inkling_moe_forward`: the float32 router over routed
  and shared experts (sigmoid from ``exp`` plus ``e_score_correction_bias`` for the choice, the weights of the k
  chosen and the shared experts ``sigmoid(l) / sum sigmoid(l)`` from ``exp`` where upstream takes ``logsigmoid`` and
  ``logsumexp``, whose float32 ``log`` moves an element with its offset; times ``route_scale * global_scale``), the
  routed experts summed per token in top-k order, and the shared experts (upstream's ``bmm`` stack) one by one through
  the row-invariant linear, weighted by their gammas and summed in float32.
- ZAYA's ``ZayaExperts`` runs :func:`zaya_experts_forward`: the experts its router chose, summed per token in
  top-k order.
- Inkling 2's ``Inkling2SparseMoeBlock`` (every layer; Inkling 2 Loop's copy alike) runs
  :func:`inkling2_moe_forward`: the float32 sigmoid router with its score correction, the softcapped SwiGLU experts
  (their module patched by :mod:`.inkling2_deterministic`), summed per token in float32 in top-k order.

Upstream code mirrored: ``GraniteMoeHybridTopKRouter`` / ``GraniteMoeHybridExperts`` / ``GraniteMoeHybridMoE``
(``transformers/models/granitemoehybrid/modeling_granitemoehybrid.py``), ``NemotronHTopkRouter`` /
``NemotronHExperts`` / ``NemotronHMoE`` (``models/nemotron_h/modeling_nemotron_h.py``) and ``InklingTopkRouter`` /
``InklingExperts`` / ``InklingSharedExperts`` / ``InklingMoE`` (``models/inkling/modeling_inkling.py``), transformers
5.23 - 5.25.
Upstream sums a token's experts in expert order (``index_add_``); here in its top-k order (also fixed per token,
no scatter). Nemotron-H's experts round each weighted expert output to the model's dtype before the sum, as 5.25
does (5.23 and 5.24 summed in float32 and rounded once: the same bits in float32, round-off apart in bf16).
``torch.sigmoid`` and ``torch.softmax`` give an element other float32 bits by its offset in the tensor; ``exp``,
relu, products and the top-k's choices do not.

:data:`_OFF` is the private switch of the power tests: ``"router"`` takes the routers' sigmoid / softmax from torch,
``"experts"`` runs the routed experts as upstream's experts module does (``F.linear`` on each expert's rows, summed
in expert order), ``"shared"`` Inkling's shared experts as upstream (``bmm``), Inkling's router its weights from
``logsigmoid`` / ``logsumexp`` under ``"router"``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..kernels.gated_delta_invariant import sigmoid_invariant
from .mamba1_deterministic import linear as _linear

#: Ingredients switched off (private: the power tests name them here; empty in use).
_OFF: set[str] = set()


def routed_sum(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
               expert: Callable[[torch.Tensor, int], torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum_k w_k expert_k(x)`` ``[N, hidden]`` (``x``'s dtype) per token in its top-k order, for ``x``
    ``[N, hidden]``, ``weights`` / ``chosen`` ``[N, k]``: ``expert(rows [n, hidden], e)`` is expert ``e`` on the rows
    routed to it; each weighted output is rounded to ``dtype`` (default ``x``'s) before the sum, the sum to ``x``'s
    dtype after it."""
    top_k = chosen.shape[1]
    picked = x.new_zeros(x.shape[0], top_k, x.shape[1], dtype=dtype or x.dtype)
    for index in chosen.unique().tolist():
        token, slot = torch.where(chosen == index)
        picked[token, slot] = (expert(x[token], index) * weights[token, slot, None]).to(picked.dtype)
    total = picked[:, 0]
    for slot in range(1, top_k):
        total = total + picked[:, slot]
    return total.to(x.dtype)


def gated_expert(experts: torch.nn.Module, activation: Callable[[torch.Tensor], torch.Tensor]):
    """Expert ``e`` of a gate-up experts module (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) as
    :func:`routed_sum` calls it: ``down(activation(gate) * up)`` through the row-invariant linear; with an experts
    ``limit`` (Ling's clipped SwiGLU, transformers 5.25) the activation is clamped above and ``up`` to ``+-limit``."""
    def expert(rows: torch.Tensor, index: int) -> torch.Tensor:
        gate, up = _linear(rows, experts.gate_up_proj[index]).chunk(2, dim=-1)
        act, limit = activation(gate), getattr(experts, "limit", None)
        if limit is not None:
            act, up = act.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return _linear(act * up, experts.down_proj[index])
    return expert


def _ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, k]`` summed over ``k`` left to right -> ``[N, 1]``."""
    total = x[:, :1]
    for slot in range(1, x.shape[1]):
        total = total + x[:, slot:slot + 1]
    return total


def softmax_invariant(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` over the last dim of ``logits`` ``[N, k]`` float32, sorted descending (a top-k's values),
    as ``exp(l - l_0) / sum`` with the sum in column order."""
    if "router" in _OFF:
        return torch.softmax(logits, dim=-1)
    shifted = torch.exp(logits - logits[:, :1])
    return shifted / _ordered_sum(shifted)


def granite_moe_forward(block: torch.nn.Module, original, layer_input: torch.Tensor) -> torch.Tensor:
    """``GraniteMoeHybridMoE``'s output ``[B, T, hidden]`` (the input's dtype) for ``layer_input`` ``[B, T, hidden]``:
    top-k of the router's logits (computed in the input's dtype, then float32), their softmax rounded to the input's
    dtype, and the experts summed per token in top-k order."""
    batch, seq_len, hidden = layer_input.shape
    x = layer_input.reshape(-1, hidden)
    logits = _linear(x, block.router.weight).float()
    top_logits, chosen = logits.topk(block.router.top_k, dim=-1)
    weights = softmax_invariant(top_logits).type_as(x)
    if "experts" in _OFF:
        return block.experts(x, chosen, weights).view(batch, seq_len, hidden)
    experts = block.experts
    return routed_sum(x, weights, chosen, gated_expert(experts, experts.act_fn)).view(batch, seq_len, hidden)


def nemotron_route(router: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``NemotronHTopkRouter``'s ``(weights [N, k] float32, chosen [N, k])`` for ``x`` ``[N, hidden]``, chosen in
    descending order of ``score + e_score_correction_bias`` inside the best ``topk_group`` groups."""
    logits = _linear(x.float(), router.weight.float())
    scores = torch.sigmoid(logits) if "router" in _OFF else sigmoid_invariant(logits)
    for_choice = scores + router.e_score_correction_bias
    per_group = router.num_experts // router.num_group
    group_scores = for_choice.view(-1, router.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    groups = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, router.num_group, per_group).reshape(-1, router.num_experts)
    for_choice = for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    chosen = torch.topk(for_choice, k=router.top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if router.norm_topk_prob:
        weights = weights / (_ordered_sum(weights) + 1e-20)
    return weights * router.routed_scaling_factor, chosen


def nemotron_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """``NemotronHMoE``'s output ``[B, T, hidden]`` (the input's dtype) for ``hidden_states`` ``[B, T, hidden]``: the
    routed experts (:func:`nemotron_route`; ``down(act(up(x)))`` each, inside the latent projections where the config
    has them) plus the shared experts' MLP."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    weights, chosen = nemotron_route(block.gate, x)
    latent = block.fc1_latent_proj(x)
    experts = block.experts
    if "experts" in _OFF:
        routed = experts(latent, chosen, weights)
    else:
        def expert(rows: torch.Tensor, index: int) -> torch.Tensor:
            return _linear(experts.act_fn(_linear(rows, experts.up_proj[index])), experts.down_proj[index])
        routed = routed_sum(latent, weights, chosen, expert)
    return block.fc2_latent_proj(routed).view(shape) + block.shared_experts(hidden_states)


def _sigmoid_shares(logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid(l_i) / sum_j sigmoid(l_j)`` ``[N, m]`` float32 for ``logits`` ``[N, m]`` float32 (upstream's
    ``exp(logsigmoid(l) - logsumexp(logsigmoid(l)))``, whose ``log`` moves an element with its offset) from ``exp``
    only: each ``sigmoid(l_i) / sigmoid(l_max)``, written so that no ``exp`` overflows into ``inf / inf``, over their
    sum in column order."""
    if "router" in _OFF:
        log_probs = torch.nn.functional.logsigmoid(logits)
        return torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
    top = logits.max(dim=-1, keepdim=True)[0]
    high = (1 + torch.exp(-top)) / (1 + torch.exp(-logits))  # top >= 0: exp(-top) <= 1
    low = (torch.exp(top) + 1) / (torch.exp(top) + torch.exp(top - logits))  # top < 0: exp(top) < 1
    ratios = torch.where(top >= 0, high, low)
    return ratios / _ordered_sum(ratios)


def inkling_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """``InklingMoE``'s output ``[B, T, hidden]`` (the input's dtype) for ``hidden_states`` ``[B, T, hidden]``
    (``InklingTopkRouter`` / ``InklingExperts`` / ``InklingSharedExperts``, transformers 5.23 - 5.25): float32 router
    logits through the row-invariant linear over the routed and shared experts, the top-k routed experts by
    ``sigmoid`` (from ``exp``) plus ``e_score_correction_bias``, the weights of the k chosen and the shared experts
    ``sigmoid(l) / sum sigmoid(l)`` (:func:`_sigmoid_shares`) times ``route_scale * global_scale``, rounded to the
    input's dtype; the routed experts summed per token in top-k order (:func:`routed_sum`), plus each shared expert
    ``down(act(gate(x)) * up(x) * gamma)`` through the row-invariant linear, summed in float32 in expert order and
    rounded once, as upstream's ``bmm`` stack sums them."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router, experts, shared = block.gate, block.experts, block.shared_experts
    n_shared = router.n_shared_experts
    logits = _linear(x.float(), router.weight.float())
    routed_logits, shared_logits = logits[:, :-n_shared], logits[:, -n_shared:]
    scores = torch.sigmoid(logits)[:, :-n_shared] if "router" in _OFF else sigmoid_invariant(routed_logits)
    chosen = torch.topk(scores + router.e_score_correction_bias.float(), router.top_k, dim=-1)[1]
    weights = _sigmoid_shares(torch.cat([routed_logits.gather(-1, chosen), shared_logits], dim=-1))
    weights = (weights * router.route_scale * router.global_scale.float()).to(x.dtype)
    routed_weights, gammas = weights[:, :router.top_k].contiguous(), weights[:, router.top_k:].contiguous()
    if "experts" in _OFF:
        routed = experts(x, chosen, routed_weights)
    else:
        routed = routed_sum(x, routed_weights, chosen, gated_expert(experts, experts.act_fn))
    if "shared" in _OFF:
        return routed.view(shape) + shared(hidden_states, gammas=gammas)
    total = None
    for index in range(n_shared):
        gate, up = _linear(x, shared.gate_proj[index]), _linear(x, shared.up_proj[index])
        down = _linear(shared.act_fn(gate) * up * gammas[:, index:index + 1], shared.down_proj[index]).float()
        total = down if total is None else total + down
    return routed.view(shape) + total.to(x.dtype).view(shape)


def zaya_experts_forward(experts: torch.nn.Module, original, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    """``ZayaExperts``' output ``[N, hidden]`` (the input's dtype) for ``hidden_states`` ``[N, hidden]`` and the
    router's ``top_k_index`` / ``top_k_weights`` ``[N, k]`` (``ZayaExperts.forward``, transformers 5.23 - 5.25): each
    expert ``down(act(gate(x)) * up(x))`` through the row-invariant linear, summed per token in its top-k order
    (:func:`routed_sum`). The router (``ZayaRouter``: its MLP's GELU patched, its softmax a per-row reduction) ran as
    upstream and masked a choice of the skip expert to expert 0 with weight 0, whose term adds a zero here as there."""
    if "experts" in _OFF:
        return original(hidden_states, top_k_index, top_k_weights)
    return routed_sum(hidden_states, top_k_weights, top_k_index, gated_expert(experts, experts.act_fn))


def inkling2_moe_forward(block: torch.nn.Module, original, hidden_states: torch.Tensor) -> torch.Tensor:
    """``Inkling2SparseMoeBlock``'s output ``[B, T, hidden]`` (the input's dtype) for ``hidden_states``
    ``[B, T, hidden]`` (``Inkling2TopKRouter`` / ``Inkling2Experts``, transformers 5.23 - 5.25): float32 router logits
    through the row-invariant linear, sigmoid scores from ``exp``, the top-k by score plus
    ``e_score_correction_bias``, the chosen scores over their sum in top-k order times ``routed_scaling_factor``;
    each expert ``down(act_fn(gate, up))`` (its softcapped SwiGLU module, patched) through the row-invariant linear,
    weighted and summed per token in float32 in top-k order, rounded once (upstream adds in float32 in expert
    order)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router, experts = block.gate, block.experts
    logits = _linear(x.float(), router.weight.float())
    scores = torch.sigmoid(logits) if "router" in _OFF else sigmoid_invariant(logits)
    chosen = torch.topk(scores + router.e_score_correction_bias.float(), router.top_k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    weights = weights / (_ordered_sum(weights) + 1e-20) * router.routed_scaling_factor
    if "experts" in _OFF:
        return experts(x, chosen, weights).view(shape)

    def expert(rows: torch.Tensor, index: int) -> torch.Tensor:
        gate, up = _linear(rows, experts.gate_up_proj[index]).chunk(2, dim=-1)
        return _linear(experts.act_fn(gate, up), experts.down_proj[index])
    return routed_sum(x, weights, chosen, expert, dtype=torch.float32).view(shape)


#: Experts block class -> its deterministic forward (``hybrid_deterministic.install`` patches them by name).
FORWARDS = {"GraniteMoeHybridMoE": granite_moe_forward, "NemotronHMoE": nemotron_moe_forward,
            "InklingMoE": inkling_moe_forward, "ZayaExperts": zaya_experts_forward,
            "Inkling2SparseMoeBlock": inkling2_moe_forward, "Inkling2LoopSparseMoeBlock": inkling2_moe_forward}


def product_weights(block: torch.nn.Module) -> list[torch.Tensor]:
    """The weights of the products a :data:`FORWARDS` block runs outside ``torch.nn.Linear`` modules, in the dtype
    they run in (the row-invariance probes): the router's, one expert's."""
    if type(block).__name__ == "NemotronHMoE":
        return [block.gate.weight.float(), block.experts.up_proj[0], block.experts.down_proj[0]]
    if type(block).__name__ == "ZayaExperts":  # its router's products are nn.Linear modules
        return [block.gate_up_proj[0], block.down_proj[0]]
    if type(block).__name__ == "InklingMoE":
        shared = block.shared_experts
        return [block.gate.weight.float(), block.experts.gate_up_proj[0], block.experts.down_proj[0],
                shared.gate_proj[0], shared.up_proj[0], shared.down_proj[0]]
    if type(block).__name__ in ("Inkling2SparseMoeBlock", "Inkling2LoopSparseMoeBlock"):
        return [block.gate.weight.float(), block.experts.gate_up_proj[0], block.experts.down_proj[0]]
    return [block.router.weight, block.experts.gate_up_proj[0], block.experts.down_proj[0]]
