"""A drafter from the MTP (multi-token prediction) head a checkpoint ships: the ``mtp.*`` weights of its safetensors,
which transformers drops at load, read with ``safetensors`` into the head :mod:`~hf_hybridcache._compat.mtp` builds
(dense Qwen3.5 for now).

The head drafts from the target's final hidden states, which the engine hands over for every position a request
keeps (``Drafter.observe``: prefill chunks, decodes, a verify step's kept positions). For a request whose tokens are
``x_0 .. x_n`` (``x_n`` sampled, not fed yet) and whose hidden states ``h_j`` are known up to ``h_{n-1}``, one round
runs the head over the pairs ``(x_{j+1}, h_j)`` of the last ``window_tokens`` positions (causal, positions ``j``),
takes the target's ``lm_head`` argmax of its last output as ``d_1``, then feeds ``(d_i, m_i)`` one at a time (``m_i``
the head's previous output) for ``d_2 .. d_k``, over a cache of the head's own layers that lives for the round only.
So the head attends to the last ``window_tokens`` positions, not the whole sequence as vLLM's MTP does (it keeps the
head's keys for every position): drafts may be worse on long contexts, never wrong (the target verifies them). A
prefix hit's positions have no hidden states (they never ran): the window starts after them. Drafts are greedy (a
point-mass proposal, exact under sampling too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import torch

from .._compat.mtp import MTPHead, mtp_support_error, new_head_cache
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


class MTPDrafter(Drafter):
    """Drafts with the MTP head of the checkpoint in ``folder`` (the target's own: its ``mtp.*`` weights).

    Args:
        folder: the target checkpoint's folder (its safetensors hold ``mtp.*``).
        window_tokens: past positions the head attends to per round (>= 1).

    Raises:
        ValueError: ``window_tokens`` < 1 or a folder without MTP weights (:func:`read_mtp_weights`); at
            :meth:`start`, a target family whose head is not built here or weights that do not fit its head (the
            names missing and unexpected are listed).
    """

    wants_hidden_states = True

    def __init__(self, folder: str | os.PathLike, window_tokens: int = 64) -> None:
        if isinstance(window_tokens, bool) or not isinstance(window_tokens, int) or window_tokens < 1:
            raise ValueError(f"window_tokens must be a positive int, got {window_tokens!r}.")
        self.folder, self.window_tokens = folder, window_tokens
        self.weights = read_mtp_weights(folder)  # refused here, before a server loads its target
        self.head: MTPHead | None = None
        self._hidden: dict[object, tuple[int, torch.Tensor]] = {}  # request -> (first position, [n, H])

    def start(self, engine) -> None:
        target = engine.cache.model
        problem = mtp_support_error(target.config)
        if problem is not None:
            raise ValueError(problem)
        weight = target.get_input_embeddings().weight
        head = MTPHead(target.config)
        missing, unexpected = head.load_state_dict(self.weights, strict=False)
        missing = [k for k in missing if "rotary_emb" not in k]
        if missing or unexpected:
            raise ValueError(f"The MTP weights in {self.folder!r} do not fit a {type(target).__name__} head: missing "
                             f"{missing}, unexpected {unexpected}.")
        self.head = head.to(device=weight.device, dtype=weight.dtype).eval()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self._hidden.clear()

    def observe(self, request, past: int, hidden: torch.Tensor) -> None:
        first, known = self._hidden.get(request, (past, hidden[:0]))
        end = first + len(known)
        if past > end or past < first:  # a gap (a prefix hit) or a recompute from before: start over here
            first, known = past, hidden[:0]
        known = torch.cat([known[: past - first], hidden])[-self.window_tokens :]
        self._hidden[request] = (past + len(hidden) - len(known), known)

    @torch.no_grad()
    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> list[list[int]]:
        return [self._draft(request, n) for request, n in zip(requests, num_tokens)]

    def _draft(self, request, num_tokens: int) -> list[int]:
        tokens = request.tokens
        first, known = self._hidden.get(request, (0, None))
        if known is None or not len(known) or first + len(known) != len(tokens) - 1:
            return []  # the hidden state of its last fed position is not known
        device = known.device
        ids = torch.tensor(tokens[first + 1 :], device=device)[None]  # x_{j+1} for each known h_j
        positions = torch.arange(first, first + len(known), device=device)[None]
        cache, hidden, drafts = new_head_cache(), known[None], []
        for _ in range(num_tokens):
            out = self.head(self.embed(ids), hidden, positions, cache)[:, -1:]
            drafts.append(int(self.lm_head(out)[0, -1].argmax()))
            ids, hidden, positions = torch.tensor([[drafts[-1]]], device=device), out, positions[:, -1:] + 1
        return drafts

    def release(self, request) -> None:
        self._hidden.pop(request, None)

    def close(self) -> None:
        self._hidden.clear()
