"""One prompt's images: where their placeholder tokens are, the keys that stand for those tokens in block hashes, and
the encoding of only the images a hit does not cover.

Every placeholder token of an image has the same token id, so two prompts with equal ids and different images would
share blocks. The cache therefore chains its block hashes over *token keys*: the token id everywhere but on a
placeholder, where the key is ``-1 - ((d + j) mod 2**56)`` for the ``j``-th placeholder of an item whose content
digest starts with the 56-bit integer ``d`` (SHA-256 over the item's pixel rows, grid and masks, with their dtypes
and shapes). Keys are negative, so they never equal a token id, and the chain hash of a block covers the content of
every image whose placeholders it holds and the position inside it: two prompts with equal ids share only the
blocks before the first placeholder of the first image that differs. This is SGLang's ``pad_value`` (an image's hash
written over its placeholder ids before the radix tree sees them) with 56 bits instead of 30, and plays the part of
vLLM's ``mm_hash`` in its block-hash extra keys. Stored blocks keep the keys, and a hit re-compares them.

On a hit of ``P`` tokens, an item whose placeholders all lie before ``P`` is not encoded at all (its features only
ever fed the restored KV and states); an item that straddles ``P`` or lies after it is encoded, and only the feature
rows of its placeholders at or after ``P`` are handed to the model (``mm_encoder_outputs``, as transformers' chunked
prefill slices them).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .wrappers import Modality, modalities_of

_KEY_SPACE = 1 << 56


@dataclass(frozen=True)
class Item:
    """One image (video, tile) of a prompt.

    Attributes:
        modality: how its wrapper keeps it.
        index: its place among the items of its modality.
        digest: SHA-256 of its inputs (pixel rows, grid, masks, with dtypes and shapes).
        positions: the prompt positions of its placeholder tokens, ascending.
    """

    modality: Modality
    index: int
    digest: bytes
    positions: tuple[int, ...]

    def keys(self) -> list[int]:
        base = int.from_bytes(self.digest[:7], "little")
        return [-1 - (base + j) % _KEY_SPACE for j in range(len(self.positions))]


@dataclass
class ImageReport:
    """What the encoding of one request's images did.

    Attributes:
        items: the prompt's items.
        encoded: items run through the vision tower (they reach into the uncached tail).
        skipped: items inside the restored prefix, not encoded.
        encoder_calls: calls of a feature method (one per modality that had items to encode).
        encoder_seconds: wall time of those calls.
    """

    items: int = 0
    encoded: int = 0
    skipped: int = 0
    encoder_calls: int = 0
    encoder_seconds: float = 0.0


def _digest(modality: Modality, tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    h = hashlib.sha256(modality.name.encode())
    for name, tensor in tensors:
        data = tensor.detach().contiguous().cpu()
        h.update(f"|{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.digest()


def _runs(positions: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][-1] == p - 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


@dataclass
class ImagePrompt:
    """The items of one single-row prompt and the inputs they were cut from.

    Attributes:
        model: the wrapper.
        items: every item, grouped by modality in the order of its modalities.
        inputs: ``{keyword: tensor}``, the pixel inputs the items were cut from (taken out of ``generate()``'s
            kwargs, so that it does not encode them itself).
        report: what :meth:`encode` did.
    """

    model: torch.nn.Module
    items: list[Item]
    inputs: dict[str, torch.Tensor]
    report: ImageReport = field(default_factory=ImageReport)

    @classmethod
    def build(cls, model: torch.nn.Module, input_ids: torch.Tensor, kwargs: dict) -> ImagePrompt | None:
        """The items of the prompt ``input_ids`` ``[1, T]`` whose pixel inputs are in ``kwargs``, or None when the
        placeholder tokens do not add up to what the inputs describe (the model's own check then raises)."""
        ids = input_ids[0].tolist()
        items, inputs = [], {}
        for modality in modalities_of(model):
            if kwargs.get(modality.pixels) is None:
                continue
            found = _modality_items(model, modality, ids, kwargs)
            if found is None:
                return None
            items += found
            inputs.update({name: kwargs[name] for name in modality.inputs if kwargs.get(name) is not None})
        return cls(model, items, inputs, ImageReport(items=len(items)))

    def keys(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token keys ``[1, T]`` of the prompt ``input_ids`` ``[1, T]`` (the module docstring)."""
        keys = input_ids.detach().cpu().clone()
        for item in self.items:
            keys[0, list(item.positions)] = torch.tensor(item.keys(), dtype=keys.dtype)
        return keys

    def encode(self, hit_tokens: int) -> dict[str, BaseModelOutputWithPooling]:
        """``mm_encoder_outputs`` for the forward of the prompt's positions ``[hit_tokens, T)``: per modality, the
        feature rows of its placeholders there, from one call of its feature method on the items that reach there
        (none for a modality whose items all lie in the restored prefix). Fills :attr:`report`."""
        outputs = {}
        for modality in dict.fromkeys(item.modality for item in self.items):
            items = [i for i in self.items if i.modality is modality]
            needed = [i for i in items if i.positions[-1] >= hit_tokens]
            self.report.skipped += len(items) - len(needed)
            if needed:
                outputs[modality.name] = self._encode(modality, items, needed, hit_tokens)
        return outputs

    def _encode(self, modality: Modality, items: list[Item], needed: list[Item], hit_tokens: int):
        kwargs = _select(modality, self.inputs, items, [i.index for i in needed], self.model.config)
        method = getattr(self.model.base_model, f"get_{modality.name}_features")
        device = next(self.model.parameters()).device
        started = time.perf_counter()
        pooled = method(**kwargs, return_dict=True).pooler_output
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.report.encoder_seconds += time.perf_counter() - started
        self.report.encoder_calls += 1
        self.report.encoded += len(needed)
        rows, offset = [], 0
        for item in needed:
            rows += [offset + j for j, p in enumerate(item.positions) if p >= hit_tokens]
            offset += len(item.positions)
        flat = pooled if isinstance(pooled, torch.Tensor) else torch.cat([f.reshape(-1, f.shape[-1]) for f in pooled])
        kept = flat.index_select(0, torch.tensor(rows, device=flat.device))
        return BaseModelOutputWithPooling(pooler_output=kept if isinstance(pooled, torch.Tensor) else [kept])


def _modality_items(model, modality: Modality, ids: list[int], kwargs: dict) -> list[Item] | None:
    token_id = getattr(model.config, modality.token_id)
    positions = [p for p, t in enumerate(ids) if t == token_id]
    pixels = kwargs[modality.pixels]
    if modality.grid is None:  # Inkling: one pixel row per placeholder, items are runs of placeholders
        if pixels.shape[0] != len(positions):
            return None
        runs, start, items = _runs(positions), 0, []
        for index, run in enumerate(runs):
            chunk = pixels[start : start + len(run)]
            items.append(Item(modality, index, _digest(modality, [(modality.pixels, chunk)]), tuple(run)))
            start += len(run)
        return items
    grid = kwargs[modality.grid]
    pixel_rows = modality.pixel_rows(grid, model.config)
    feature_rows = modality.feature_rows(grid, model.config)
    if sum(pixel_rows) != pixels.shape[0] or sum(feature_rows) != len(positions):
        return None
    items, start = [], 0
    for index, (chunk, count) in enumerate(zip(pixels.split(pixel_rows), feature_rows)):
        per_item = {name: kwargs[name][index] for name in modality.per_item if kwargs.get(name) is not None}
        chunk, per_item = _unpadded(modality, chunk, per_item)
        tensors = [(modality.pixels, chunk), (modality.grid, grid[index]), *per_item.items()]
        items.append(Item(modality, index, _digest(modality, tensors), tuple(positions[start : start + count])))
        start += count
    return items


def _unpadded(modality: Modality, chunk: torch.Tensor, per_item: dict) -> tuple[torch.Tensor, dict]:
    """An item's pixel rows ``[1, L, ...]`` and padding mask ``[L]`` cut after its last real row (the padding to the
    call's longest item, which the tower masks out), so that its digest names its own pixels only."""
    mask = per_item.get(modality.padding_mask) if modality.padding_mask else None
    if mask is None:
        return chunk, per_item
    real = mask.nonzero()
    length = int(real[-1, 0]) + 1 if len(real) else 0
    return chunk[:, :length], {**per_item, modality.padding_mask: mask[:length]}


def _select(modality: Modality, inputs: dict, items: list[Item], indices: list[int], config) -> dict:
    """The feature method's kwargs for the items ``indices`` of ``items`` (all of them: the inputs as given)."""
    present = {name: inputs[name] for name in modality.inputs if name in inputs}
    if len(indices) == len(items):
        return present
    if modality.grid is None:
        rows = [sum(len(i.positions) for i in items[:k]) + j for k in indices for j in range(len(items[k].positions))]
        return {modality.pixels: present[modality.pixels][rows]}
    pixel_rows = modality.pixel_rows(present[modality.grid], config)
    chunks = present[modality.pixels].split(pixel_rows)
    selected = {modality.pixels: torch.cat([chunks[k] for k in indices])}
    index = torch.tensor(indices, device=present[modality.grid].device)
    for name in (modality.grid, *modality.per_item):
        if name in present:
            selected[name] = present[name].index_select(0, index.to(present[name].device))
    return selected


def key_placeholders(token_ids: list[int], start: int, keys: list[int] | None, placeholders: frozenset[int]) -> bool:
    """Put the prompt's token ``keys`` over ``token_ids[start:]`` where they reach (a request's row records the ids
    it is fed from ``start`` on); False when a placeholder id is left without a key (a forward fed an image's
    placeholders without the image: nothing of it may be stored under its ids)."""
    if keys is not None:
        end = min(len(token_ids), len(keys))
        token_ids[start:end] = keys[start:end]
        start = max(start, end)
    return not placeholders or placeholders.isdisjoint(token_ids[start:])
