"""A drafter from the MTP (multi-token prediction) head a checkpoint ships: the ``mtp.*`` weights of its safetensors,
which transformers drops at load, read with ``safetensors`` into the head :mod:`~hf_hybridcache._compat.mtp` builds
(Qwen3.5, Qwen3.5-MoE and Qwen3-Next; routed experts fused as transformers fuses the main model's).

The head drafts from the target's final hidden states, which the engine hands over for every position a request
keeps (``Drafter.observe``: prefill chunks, decodes, a verify step's kept positions). For a request whose tokens are
``x_0 .. x_n`` (``x_n`` sampled, not fed yet) and whose hidden states ``h_j`` are known up to ``h_{n-1}``, one round

1. feeds the head the pairs ``(x_{j+1}, h_j)`` it has not seen yet (positions ``j``; every pair once: the head keeps
   its keys and values for every position of the request, as vLLM's MTP does), and keeps its output ``m_n`` of the
   last one;
2. takes the target's ``lm_head`` argmax of ``m_n`` as ``d_1``, then feeds ``(d_i, m_{n+i-1})`` one at a time for
   ``d_2 .. d_k``;
3. cuts the head's cache back to the pairs of step 1 (the drafts' keys go: a draft's pair is fed again, as a kept
   token's, once the target keeps it).

A kept position's hidden state never changes, so the pairs fed stay valid; a request recomputed from an earlier
position (preempted) cuts the head's cache back to it. A prefix hit's positions have no hidden states (they never
ran): the head's pairs start after them. Drafts are greedy (a point-mass proposal, exact under sampling too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._compat.mtp import MTPHead, cut_head_cache, fuse_experts, mtp_support_error, new_head_cache
from .drafters import Drafter

#: The prefix of an MTP head's keys in a checkpoint's safetensors.
MTP_PREFIX = "mtp."


def read_mtp_weights(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of the checkpoint in ``folder`` (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names), keys without ``mtp.``, on the CPU in their stored dtype.

    Raises:
        ValueError: ``folder`` is not a folder, holds no safetensors, or its safetensors hold no ``mtp.*`` keys.
    """
    from safetensors import safe_open

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"MTP weights are read from a checkpoint folder; {folder!r} is not one (download the "
                         "checkpoint, e.g. huggingface-cli download, and pass its folder).")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({file for key, file in weight_map.items() if key.startswith(MTP_PREFIX)})
    else:
        files = [f for f in sorted(os.listdir(folder)) if f.endswith(".safetensors")]
    weights = {}
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt") as opened:
            for key in opened.keys():
                if key.startswith(MTP_PREFIX):
                    weights[key[len(MTP_PREFIX):]] = opened.get_tensor(key)
    if not weights:
        raise ValueError(f"{folder!r} holds no {MTP_PREFIX}* weights in its safetensors: this checkpoint ships no MTP "
                         "head (or it was saved by transformers, which drops them); use the n-gram drafter or a "
                         "draft model.")
    return weights


@dataclass
class _HeadState:
    """A request's pairs in the head: ``cache`` holds the keys of ``fed`` pairs from position ``start`` on, ``pending``
    ``[p, H]`` the hidden states observed after them, ``last`` ``[1, 1, H]`` the head's output of the last pair fed."""

    start: int
    cache: object
    pending: torch.Tensor
    fed: int = 0
    last: torch.Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.fed + len(self.pending)


class MTPDrafter(Drafter):
    """Drafts with the MTP head of the checkpoint in ``folder`` (the target's own: its ``mtp.*`` weights).

    Args:
        folder: the target checkpoint's folder (its safetensors hold ``mtp.*``).

    Memory: the head's keys and values for every position of each running request (one attention layer's worth,
    outside the engine's page budget), freed when the request leaves.

    Raises:
        ValueError: a folder without MTP weights (:func:`read_mtp_weights`); at :meth:`start`, a target family whose
            head is not built here or weights that do not fit its head (the names missing and unexpected are listed).
    """

    wants_hidden_states = True

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = folder
        self.weights = read_mtp_weights(folder)  # refused here, before a server loads its target
        self.head: MTPHead | None = None
        self._states: dict[object, _HeadState] = {}

    def start(self, engine) -> None:
        target = engine.cache.model
        problem = mtp_support_error(target.config)
        if problem is not None:
            raise ValueError(problem)
        weight = target.get_input_embeddings().weight
        head = MTPHead(target.config)
        try:
            missing, unexpected = head.load_state_dict(fuse_experts(self.weights), strict=False)
        except RuntimeError as error:  # a size mismatch: the head of another model (another width, vocabulary)
            sizes = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
            raise ValueError(f"The MTP weights in {self.folder!r} are not this {type(target).__name__}'s head (their "
                             f"shapes differ from its config's: {'; '.join(sizes[:3]) or error}); serve the "
                             "checkpoint they came with, or pass that checkpoint's folder.") from None
        missing = [k for k in missing if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"The MTP weights in {self.folder!r} do not fit a {type(target).__name__} head: missing "
                             f"{missing}, unexpected {unexpected}.")
        self.head = head.to(device=weight.device, dtype=weight.dtype).eval()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self._states.clear()

    def observe(self, request, past: int, hidden: torch.Tensor) -> None:
        state = self._states.get(request)
        if state is None or past < state.start or past > state.end:  # new, or a gap (a prefix hit): start here
            self._states[request] = _HeadState(past, new_head_cache(), hidden.clone())
        elif past < state.start + state.fed:  # recomputed from a position the head has fed: cut back to it
            state.fed = past - state.start
            cut_head_cache(state.cache, state.fed)
            state.pending, state.last = hidden.clone(), None
        else:
            state.pending = torch.cat([state.pending[: past - state.start - state.fed], hidden])

    @torch.no_grad()
    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        return [self._draft(request, n) for request, n in zip(requests, num_tokens)]

    def _draft(self, request, num_tokens: int) -> list[int]:
        tokens, state = request.tokens, self._states.get(request)
        if state is None or state.end != len(tokens) - 1:
            return []  # the hidden state of its last fed position is not known
        if len(state.pending):
            first = state.start + state.fed
            state.last = self._run(tokens[first + 1 :], state.pending[None], first, state.cache)[:, -1:]
            state.fed, state.pending = state.fed + len(state.pending), state.pending[:0]
        if state.last is None:
            return []
        out, drafts = state.last, []
        for i in range(num_tokens):
            drafts.append(int(self.lm_head(out)[0, -1].argmax()))
            if i + 1 < num_tokens:
                out = self._run(drafts[-1:], out, len(tokens) - 1 + i, state.cache)
        cut_head_cache(state.cache, state.fed)
        return drafts

    def _run(self, ids: list[int], hidden: torch.Tensor, first: int, cache) -> torch.Tensor:
        """The head's outputs ``[1, T, H]`` for tokens ``ids`` and hidden states ``[1, T, H]`` at positions
        ``first ..``, continuing over ``cache``."""
        device = hidden.device
        positions = torch.arange(first, first + len(ids), device=device)[None]
        return self.head(self.embed(torch.tensor([ids], device=device)), hidden, positions, cache)

    def release(self, request) -> None:
        self._states.pop(request, None)

    def close(self) -> None:
        self._states.clear()
