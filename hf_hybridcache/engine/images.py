"""Images in engine requests: a vision-language wrapper's prompts with their pixel inputs
(:mod:`hf_hybridcache.multimodal`), served as ``generate()`` serves them (:mod:`hf_hybridcache.generate.images`).

- **Keys.** A request with images is looked up, stored and shared in flight by its *token keys* (each image's content
  digest over its placeholder ids; :attr:`EngineRequest.key_tokens <hf_hybridcache.engine.requests.EngineRequest>`),
  never by its ids, so two requests with equal ids and different images share only the blocks before the first image
  that differs.
- **Encoding at admission.** Once its hit is known, a request's images that reach into the uncached tail are encoded,
  once per request (a preempted request re-encodes only when its new hit is shorter); images entirely inside the hit
  are never encoded. The cache's image counters count both, as ``generate()``'s do.
- **Rows per chunk.** Each forward gets, per modality, the feature rows of the placeholders its segments feed, in pack
  order (``mm_encoder_outputs``, as transformers' chunked prefill slices them): the wrapper's own ``masked_scatter``
  fills the pack's placeholder tokens in that order, so requests with images share one forward. A segment that feeds
  a placeholder id without its image (a sampled one) runs in a forward without images (:func:`split_forwards`), where
  the wrapper embeds it as a token, as a cold ``generate()`` does.
- **Positions.** Qwen3.5's 3D rotary positions of a request are computed from its whole prompt at ``add_request``
  (:func:`~hf_hybridcache._compat.multimodal.rope_positions`) and given to every chunk and decode step of it
  (``position_ids`` ``[4, 1, N]``); other requests of the pack get their token positions on every row.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .._compat.multimodal import decode_positions, rope_positions
from ..multimodal import UNKEYED_INPUTS, ImagePrompt, ImageReport, modalities_of, placeholder_ids
from .plan import Segment, StepPlan

#: Inputs a processor returns beside the pixel inputs that the engine takes and recomputes from the ids (token
#: types) or does without (the prompt is unpadded).
_DERIVED = ("mm_token_type_ids", "token_type_ids", "input_ids", "attention_mask")


@dataclass(eq=False)
class RequestImages:
    """What a request's images are to the engine (shared by a request and its reply replay; read-only).

    Attributes:
        prompt: its items and pixel inputs (where they were given; copied to the model's device to be encoded).
        keys: the token keys of its first ``len(keys)`` tokens (the prompt it was added with).
        positions: Qwen3.5's 3D rotary positions ``[3, len(keys)]`` int64 (CPU) of that prompt, or None.
    """

    prompt: ImagePrompt
    keys: list[int]
    positions: torch.Tensor | None


@dataclass
class Features:
    """A request's encoded feature rows: per modality, the positions of its placeholders at or after ``hit_tokens``
    (ascending) and their rows ``[n, D]``, with whether the wrapper takes ``pooler_output`` as a list."""

    hit_tokens: int
    rows: dict[str, tuple[list[int], torch.Tensor, bool]]


def request_images(model, prompt: list[int], images) -> tuple[RequestImages | None, str | None]:
    """The images of a request for ``model`` with ``prompt`` (token ids) and ``images`` (the processor's outputs for
    the prompt besides ``input_ids``: ``{name: tensor}``, or None), or why the request cannot run."""
    placeholders = placeholder_ids(model)
    if images is None or len(images) == 0:
        found = sorted(placeholders & set(prompt))
        if found:
            return None, (f"The prompt holds image placeholder tokens (id {', '.join(map(str, found))}) and no images "
                          "were passed: pass the processor's pixel inputs with images=, or drop the placeholders.")
        return None, None
    modalities = modalities_of(model)
    if not modalities:
        return None, f"{type(model).__name__} takes no images; images= is for vision-language wrappers."
    if not isinstance(images, Mapping) or not all(isinstance(v, torch.Tensor) for v in images.values()):
        return None, ("images must map input names to tensors, as processor(text=..., images=..., "
                      "return_tensors='pt') returns them (pixel_values, image_grid_thw, ...).")
    accepted = {name for m in modalities for name in m.inputs}
    unkeyed = sorted(set(images) & set(UNKEYED_INPUTS.get(model.config.model_type, ())))
    if unkeyed:
        return None, (f"The engine does not serve {', '.join(unkeyed)} (inputs the cache cannot key blocks by); "
                      f"run such a request with generate(). Accepted: {', '.join(sorted(accepted))}.")
    unknown = sorted(set(images) - accepted - set(_DERIVED))
    if unknown:
        return None, f"Unknown image inputs {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}."
    ids = torch.tensor([prompt])
    inputs = {name: value for name, value in images.items() if name in accepted}
    missing = [f"{m.pixels} needs {m.grid}" for m in modalities
               if m.pixels in inputs and m.grid is not None and m.grid not in inputs]
    if missing:
        return None, f"Incomplete image inputs: {'; '.join(missing)} (pass every input the processor returned)."
    try:
        built = ImagePrompt.build(model, ids, inputs)
    except (IndexError, RuntimeError, TypeError, ValueError) as error:
        return None, (f"The image inputs could not be read ({type(error).__name__}: {error}); pass them as the "
                      "processor returns them.")
    if built is None:
        return None, ("The prompt's image placeholder tokens and the pixel inputs disagree (a different number of "
                      "images or of placeholders per image); pass the input_ids and pixel inputs of one processor "
                      "call.")
    covered = {p for item in built.items for p in item.positions}
    stray = sorted({t for p, t in enumerate(prompt) if t in placeholders and p not in covered})
    if stray:
        return None, (f"The prompt holds placeholder tokens (id {', '.join(map(str, stray))}) that no image input "
                      "stands for (a video, audio, or an image whose pixel inputs were not passed).")
    grids = {name: value.cpu() for name, value in inputs.items() if name.endswith("grid_thw")}
    positions = rope_positions(model, ids, grids) if built.items else None
    return RequestImages(built, built.keys(ids)[0].tolist(), positions), None


def encode(request, hit_tokens: int, counters: dict) -> None:
    """Encode ``request``'s images that reach past its ``hit_tokens`` (unless rows encoded from an earlier hit are
    kept) and add what was encoded and skipped to ``counters`` (the engine adds them to the core's under its store
    lock). A preempted request whose rows are gone counts its next admission's encoding and skipping again, as a
    second ``generate()`` call would.

    Raises:
        whatever the wrapper's feature method raises (the engine fails the request).
    """
    images = request.images
    kept = request.features
    if images is None or (kept is not None and kept.hit_tokens <= hit_tokens):
        return
    prompt = images.prompt  # its inputs stay where they were given; the tower gets a copy on its device
    device = next(prompt.model.parameters()).device
    prompt = replace(prompt, inputs={name: value.to(device) for name, value in prompt.inputs.items()},
                     report=ImageReport(items=len(prompt.items)))
    outputs = prompt.encode(hit_tokens)
    rows = {}
    for name, output in outputs.items():
        pooled = output.pooler_output
        flat = pooled if isinstance(pooled, torch.Tensor) else pooled[0]
        positions = [p for item in prompt.items if item.modality.name == name for p in item.positions
                     if p >= hit_tokens]
        rows[name] = (positions, flat, not isinstance(pooled, torch.Tensor))
    request.features = Features(hit_tokens, rows)
    new = prompt.report
    for name, value in (("images_encoded", new.encoded), ("images_skipped", new.skipped),
                        ("vision_encoder_calls", new.encoder_calls), ("vision_encoder_seconds", new.encoder_seconds)):
        counters[name] = counters.get(name, 0) + value


def encode_counted(core, request) -> str | None:
    """:func:`encode` at ``request``'s admission (from its ``past``), its counts added to ``core``'s counters under its
    store lock; returns why it failed (the tower raised: bad pixel inputs fail their request, never the engine), or
    None."""
    counters: dict = {}
    try:
        encode(request, request.past, counters)
    except Exception as error:  # noqa: BLE001 - reported as the request's error
        return f"Encoding the images failed: {type(error).__name__}: {error}"
    with core.store_lock:
        for name, value in counters.items():
            core.counters[name] = core.counters.get(name, 0) + value
    return None


def _segment_rows(segment: Segment) -> dict[str, tuple[torch.Tensor, bool]]:
    features = segment.request.features
    if features is None:
        return {}
    found = {}
    for name, (positions, rows, as_list) in features.rows.items():
        low, high = bisect.bisect_left(positions, segment.past), bisect.bisect_left(positions, segment.end)
        if high > low:
            found[name] = (rows[low:high], as_list)
    return found


def split_forwards(segments: list[Segment], placeholders: frozenset[int]) -> list[list[Segment]]:
    """``segments`` of one forward as the forwards they must run in: when some feed image rows, those that feed a
    placeholder id without its image (a sampled one) run in a forward of their own, without images."""
    if not placeholders or not any(_segment_rows(s) for s in segments):
        return [segments]
    stray = [s for s in segments if not placeholders.isdisjoint(s.request.keys_of(s.past, s.tokens))]
    rest = [s for s in segments if s not in stray]
    return [group for group in (rest, stray) if group]


def forward_inputs(plan: StepPlan) -> dict:
    """The forward's ``mm_encoder_outputs`` (the placeholders' feature rows in pack order) and, when a request of the
    pack has 3D rotary positions, its ``position_ids`` ``[4, 1, N]``; empty for a forward without images."""
    inputs = {}
    pieces: dict[str, list] = {}
    for segment in plan.segments:
        for name, (rows, as_list) in _segment_rows(segment).items():
            pieces.setdefault(name, [[], as_list])[0].append(rows)
    if pieces:
        inputs["mm_encoder_outputs"] = {
            name: BaseModelOutputWithPooling(pooler_output=[torch.cat(rows)] if as_list else torch.cat(rows))
            for name, (rows, as_list) in pieces.items()
        }
    if any(s.request.images is not None and s.request.images.positions is not None for s in plan.segments):
        rows = []
        for segment in plan.segments:
            images = segment.request.images
            if images is not None and images.positions is not None:
                rows.append(decode_positions(images.positions, segment.past, segment.end))
            else:
                rows.append(torch.arange(segment.past, segment.end)[None].expand(3, -1))
        inputs["position_ids"] = torch.cat([plan.position_ids, torch.cat(rows, dim=1)])[:, None]
    return inputs
