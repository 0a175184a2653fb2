"""What an engine step leaves in the store, by the same rules as ``generate()``'s
(:meth:`~hf_hybridcache.generate.live.LiveRequest.after_forward`), so that later requests and ``generate()`` calls
reuse it:

- every block a request completed is stored by reference to the page its KV was written to (no copy);
- checkpoints at the boundaries it keeps: the retention interval's, the mandatory prompt-end ones, its divergence
  point, the boundaries other requests sharing its prefix asked for (all kept for good), and the last boundary it
  reached (kept until a later one replaces it: the decode-end checkpoint). Boundaries inside a chunk are handed over
  by the mixers during the forward; a chunk or decode step that ends on a boundary copies the request's slot.
"""

from __future__ import annotations

from ..config import CacheOptions
from ..core import CacheCore, replay_start
from ..store import last_boundary
from ..store.retention import CheckpointPlan, plan_checkpoints
from .plan import Segment
from .requests import EngineRequest
from .slots import StateSlots


def checkpoint_plan(segment: Segment, options: CacheOptions) -> CheckpointPlan:
    """What ``segment``'s chunk keeps (:func:`~hf_hybridcache.store.retention.plan_checkpoints`, as ``generate()``
    chooses it), with the boundaries other requests sharing its prefix asked for. A reply replay keeps what its
    request would have kept with a prefill: no divergence point, which only its own lookup saw (``generate()``'s
    replay keeps none either)."""
    request = segment.request
    divergence = 0 if request.replay_of else request.row.divergence_tokens
    return plan_checkpoints(segment.past, segment.end, request.retention_prompt_tokens, options, divergence,
                            request.extra_boundaries)


def emit_positions(segment: Segment, options: CacheOptions) -> tuple[int, ...]:
    """Token counts inside ``segment``'s chunk after which the mixers must hand over its request's states: the kept
    boundaries and the last boundary reached, strictly inside the chunk."""
    start, end = segment.past, segment.end
    return tuple(sorted(b - start for b in checkpoint_plan(segment, options).wanted if b < end))


def store_segment(core: CacheCore, segment: Segment, slots: StateSlots, placeholders: frozenset[int] = frozenset()
                  ) -> None:
    """Store what ``segment``'s chunk completed (after the step's forward succeeded), under its request's token keys.
    With ``replay_replies`` (bf16, fp16) nothing past a request's first decode or verify step is stored: a decode
    step (or a verify step's few tokens over the state) rounds differently from a prefill there
    (:mod:`~hf_hybridcache.generate.reply_replay`); the engine stores the reply from a replay request when the
    request finishes (:func:`replay_request`). A chunk that feeds one of ``placeholders``
    (a vision-language wrapper's placeholder ids) without its image (a sampled one) ends the request's storing: its
    states hold a token whose content no key names."""
    request, options = segment.request, core.options
    row = request.row
    if request.speculating:  # a draft engine's request feeding draft tokens: they are not its tokens for good
        return
    if (segment.is_decode or segment.draft) and options.replay_replies and row.prefill_tokens is None:
        row.prefill_tokens = len(row.token_ids)
    keys = request.keys_of(segment.past, segment.tokens)
    row.token_ids.extend(keys)
    if placeholders and not placeholders.isdisjoint(keys):
        row.storing = False
    blocks_before = len(row.block_ids)
    core.store_pages(row, lambda index: request.pages[index])
    for index in range(blocks_before, len(row.block_ids)):
        if core.store.page_of(row.block_ids[index]) == request.pages[index]:
            request.own_pages.discard(request.pages[index])  # the store owns the page now
    captured = {b: states for b, states in segment.captured.items() if b <= row.storable_tokens}
    if segment.end % options.block_size == 0 and segment.end <= row.storable_tokens:
        captured[segment.end] = slots.read(request.slot)
    if not captured:
        return
    plan = checkpoint_plan(segment, options)
    for boundary in sorted(captured):
        stored = core.store_checkpoint(row, boundary, captured[boundary], boundary not in plan.kept)
        if stored and boundary == plan.admitted_divergence:
            core.count_divergence_checkpoint()


def replay_request(core: CacheCore, request: EngineRequest) -> EngineRequest | None:
    """The reply replay of ``request``, which just finished and stored nothing past its first decode step
    (``replay_replies``): a hidden request whose prompt is the tokens it fed up to their last block boundary (with
    its images, so that it is keyed as the request was), so that its prefill stores the reply's blocks and the
    decode-end checkpoint as a prefill computes them (as :func:`~hf_hybridcache.generate.reply_replay.replay_replies`
    does after ``generate()``). None when no block boundary was reached past the first decode step, the request
    stored nothing, or its tokens' blocks and checkpoint are stored already (the same reply again)."""
    row, block_size = request.row, core.options.block_size
    if request.replay_of or row is None or replay_start(row, block_size) is None:
        return None
    end = last_boundary(len(row.token_ids), block_size)
    replay = EngineRequest(f"{request.request_id}__replay", request.tokens[:end], max_new_tokens=1, salt=request.salt,
                           counted=True, replay_of=len(request.prompt), images=request.images)
    with core.store_lock:
        stored = core.store.find(replay.key_tokens, row.root, tail_tokens=0).hit_tokens
    return None if stored == end else replay
