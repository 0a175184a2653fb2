"""Why a request hit what it hit: one :class:`HitReport` per prompt row, for every request (``cache.last_report``)
and for a dry run (``cache.explain``) alike.

A report is made from the lookup's result (:class:`~hf_hybridcache.store.Hit`), the store, the record of evictions
and the weights states before the current one (:mod:`~hf_hybridcache.core.history`), right after the lookup and before
the request stores anything: :func:`make_report`, reached through
:meth:`CacheCore.report <hf_hybridcache.core.sharing.CacheCore.report>`, so any caller that looks up through the core
(a serving engine) makes its reports the same way. Its ``reason`` is the first of :data:`REASONS` that applies:

- ``"not_cacheable"``: the call stores and restores nothing (``use_cache=False``, training mode with dropout or
  autograd, ``inputs_embeds`` without ``input_ids``, padding inside a prompt);
- ``"too_short"``: the prompt has fewer than ``block_size + 1`` tokens;
- ``"complete"``: the hit is the last block boundary below the prompt's length (a full hit);
- ``"weights_changed"``: a longer hit is stored under an earlier weights or adapter state only;
- ``"evicted"``: a checkpoint on the prompt's path past the hit (with the KV blocks before it, if they went too) was
  stored and evicted by the budget;
- ``"no_checkpoint"``: the stored KV chain reaches past the hit but no checkpoint was kept there;
- ``"diverged"``: the hit reaches the end of the stored KV chain, where a stored block continues the prompt's prefix
  with other tokens;
- ``"new_tokens"``: the hit reaches the end of the stored KV chain and nothing is stored past it;
- ``"remote_recomputed"``: the remote tier held a longer hit, and fetching it was measured slower than recomputing;
- ``"prompt_logprobs"`` (serving engine only): the request asks for its prompt's logprobs, and the store held a longer
  hit whose tokens' logprobs were not kept (:mod:`~hf_hybridcache.engine.score_store`); given in place of the others.

The last four are exclusive by definition: ``no_checkpoint``, ``diverged`` and ``new_tokens`` say that nothing stored
(locally or in the tier) gives a longer hit, ``remote_recomputed`` that the tier does.

Cost per row: a few dictionary reads on top of the lookup, whose block hashes the report reuses; block hashes of its
own only past the stored chain while the record of evictions holds them, and under earlier weights states when the
weights changed (``benchmarks/explain_overhead.py`` measures it against a forward).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from ..config import CacheOptions
from ..hashing import BlockHash, block_hash
from ..store import Hit, PrefixStore
from .history import Eviction, EvictionLog

#: Every reason a report gives, in the order they are tried.
REASONS = (
    "not_cacheable", "too_short", "complete", "weights_changed", "evicted", "no_checkpoint", "diverged", "new_tokens",
    "remote_recomputed", "prompt_logprobs",
)
#: The logger of the per-request line (INFO: request number, hit, reason, detail); silent unless enabled.
HITS_LOGGER = "hf_hybridcache.hits"
logger = logging.getLogger(HITS_LOGGER)

#: ``not_cacheable`` details by cause.
NOT_CACHEABLE = {
    "use_cache": "generate() ran with use_cache=False, so nothing was looked up or stored; drop use_cache=False to "
    "reuse prefixes.",
    "training": "the forward ran in training mode with autograd on (a training forward), so nothing was looked up "
    "or stored; generate under torch.no_grad() or call model.eval().",
    "dropout": "the model is in training mode with a dropout probability above 0, so its forwards are random and "
    "nothing was looked up or stored; call model.eval() (or set every dropout to 0) before generating.",
    "gradient_checkpointing": "the model is in training mode with activation checkpointing, whose layers drop the "
    "cache on transformers 5.23, so nothing was looked up or stored; call model.eval() or "
    "model.gradient_checkpointing_disable() before generating.",
    "inputs_embeds": "the call passed inputs_embeds without input_ids, and prefixes are found by token ids; pass "
    "input_ids to reuse prefixes.",
    "images_batch": "the call had images and several rows (a batch, beams or num_return_sequences); prompts with "
    "images are looked up and stored one row per call, so nothing was looked up or stored.",
    "unkeyed_inputs": "the call had inputs block hashes do not cover (audio, Nemotron-H Omni's videos, precomputed "
    "mm_encoder_outputs), so nothing was looked up or stored.",
    "padding": "the attention_mask masks tokens that are not left padding, so nothing was looked up or stored; "
    "left-pad batches, and pass attention_mask=torch.ones_like(input_ids) when a prompt holds the pad id as a real "
    "token.",
}


@dataclass(frozen=True)
class HitReport:
    """Why one prompt row hit what it hit (token counts are of the row, without padding).

    Attributes:
        prompt_tokens: the prompt's length L.
        hit_tokens: tokens restored (0 on a miss); a multiple of ``block_size``, at most L - 1.
        kv_tokens: how far the stored KV chain matches the prompt's full blocks (the tier's included when it was
            asked).
        checkpoint_tokens: the deepest checkpoint on that chain at or below the last block boundary below L: the hit
            the stored entries allow. Above ``hit_tokens`` only when the tier held it and it was left there.
        reason: one of :data:`REASONS`.
        detail: one sentence a person can act on.
    """

    prompt_tokens: int
    hit_tokens: int
    kv_tokens: int
    checkpoint_tokens: int
    reason: str
    detail: str

    def __str__(self) -> str:
        return f"hit {self.hit_tokens:,} of {self.prompt_tokens:,} prompt tokens, {self.reason}: {self.detail}"


def not_cacheable(prompt_tokens: int, cause: str) -> HitReport:
    """The report of a row nothing is looked up for; ``cause`` is a key of :data:`NOT_CACHEABLE`."""
    return HitReport(prompt_tokens, 0, 0, 0, "not_cacheable", NOT_CACHEABLE[cause])


class ReportSource(Protocol):
    """What a report reads of the :class:`~hf_hybridcache.core.sharing.CacheCore` that makes it."""

    options: CacheOptions
    store: PrefixStore
    evictions: EvictionLog

    @property
    def num_requests(self) -> int: ...

    def previous_roots(self, root: BlockHash) -> list[BlockHash]: ...


def make_report(core: ReportSource, token_ids: list[int], root: BlockHash, hit: Hit) -> HitReport:
    """Why the hit of ``token_ids`` under ``root`` is ``hit`` (the result of ``core.lookup`` or ``core.peek``, taken
    before anything else changed the store); changes nothing."""
    bs, num_tokens = core.options.block_size, len(token_ids)
    local_kv = len(hit.kv_hashes) * bs
    kv_tokens = max(local_kv, hit.tier_kv_tokens)
    checkpoint_tokens = max(hit.hit_tokens, hit.tier_checkpoint_tokens)
    found = hit.hit_tokens

    def report(reason: str, detail: str) -> HitReport:
        return HitReport(num_tokens, found, kv_tokens, checkpoint_tokens, reason, detail)

    tail = core.options.min_tail_tokens  # 2 with replay_replies: the tail runs through the prefill kernels
    if num_tokens < bs + tail:
        tokens = "1 token" if num_tokens == 1 else f"{num_tokens:,} tokens"
        return report("too_short", f"the prompt has {tokens} and a hit needs block_size + {tail} = "
                      f"{bs + tail} (a full block and {'a token' if tail == 1 else f'{tail} tokens'} to run); a "
                      "smaller block_size reuses shorter prompts.")
    last = (num_tokens - tail) // bs * bs
    if found >= last:
        return report("complete", f"{found:,} of {num_tokens:,} prompt tokens were restored, up to the last block "
                      f"boundary below the prompt's length, and only the {num_tokens - found:,} after it ran.")
    for changes, old_root in enumerate(core.previous_roots(root), 1):
        older = core.store.find(token_ids, old_root, tail).hit_tokens
        if older > found:
            return report("weights_changed", f"a hit of {older:,} tokens is stored under the weights or adapters in "
                          f"use {_count(changes, 'weights change')} ago, not under the current ones; switch back to "
                          "reuse it, or expect this prompt to be stored anew under the current weights.")
    evicted = evicted_on_path(core.evictions, token_ids, root, hit.kv_hashes, found, last, bs)
    if evicted is not None:
        return report("evicted", _evicted_detail(core, evicted, local_kv))
    if checkpoint_tokens > found:
        return report("remote_recomputed", f"the remote tier holds a hit of {checkpoint_tokens:,} tokens, but fetching "
                      f"it was measured slower than recomputing the {checkpoint_tokens - found:,} tokens past the "
                      "local hit; a faster link, RemoteConfig(compute_flops_per_s=...) or a lower min_flops_per_byte "
                      "fetches it.")
    if min(kv_tokens, last) > found:
        return report("no_checkpoint", _no_checkpoint_detail(core, hit, min(kv_tokens, last), found))
    if hit.leaves_path and hit.tier_kv_tokens <= local_kv:
        return report("diverged", f"the prompt leaves the stored path at {kv_tokens:,} tokens (a stored block goes "
                      "on with other tokens) and the hit reaches that point; put the text prompts share first and "
                      "what varies last to share more.")
    return report("new_tokens", _new_tokens_detail(core, kv_tokens, bs))


def evicted_on_path(
    log: EvictionLog,
    token_ids: list[int],
    root: BlockHash,
    kv_hashes: tuple[BlockHash, ...],
    hit_tokens: int,
    last_tokens: int,
    block_size: int,
) -> tuple[int, Eviction] | None:
    """The deepest boundary in ``(hit_tokens, last_tokens]`` on the prompt's path whose checkpoint the budget evicted,
    and its record; None if none is recorded. Past the matched chain (``kv_hashes``) the path is followed, hashing its
    blocks, only while the log says their KV was evicted: a stored checkpoint always has its whole chain stored, so a
    checkpoint further on went after them."""
    if not len(log):
        return None
    found = None
    for depth in range(hit_tokens // block_size + 1, min(len(kv_hashes), last_tokens // block_size) + 1):
        eviction = log.get("checkpoint", kv_hashes[depth - 1])
        if eviction is not None:
            found = (depth * block_size, eviction)
    parent = kv_hashes[-1] if kv_hashes else root
    for depth in range(len(kv_hashes) + 1, last_tokens // block_size + 1):
        parent = block_hash(parent, token_ids[(depth - 1) * block_size : depth * block_size])
        if log.get("kv", parent) is None:
            break
        eviction = log.get("checkpoint", parent)
        if eviction is not None:
            found = (depth * block_size, eviction)
    return found


def _evicted_detail(core: ReportSource, evicted: tuple[int, Eviction], local_kv: int) -> str:
    boundary, eviction = evicted
    ago = _count(core.num_requests + 1 - eviction.request, "request")
    budget = core.options.max_cache_bytes
    what = f"the checkpoint at {boundary:,} tokens was"
    if boundary > local_kv:
        blocks = f"the KV blocks past {local_kv:,} tokens" if local_kv else "the KV blocks"
        what = f"{blocks} and the checkpoint at {boundary:,} tokens were"
    why = "when max_cache_bytes was lowered" if eviction.budget_lowered else "to stay under max_cache_bytes"
    fix = "raise it or use eviction='flop_aware'" if core.options.eviction == "lru" else (
        "raise it, or keep fewer checkpoints per prompt (a larger retention_interval) so that more prompts fit")
    return f"{what} evicted {ago} ago {why} ({_size(budget)}); {fix}."


def _no_checkpoint_detail(core: ReportSource, hit: Hit, reach: int, found: int) -> str:
    options = core.options
    past = f" past {found:,}" if found else ""
    start = (f"the stored KV chain matches {reach:,} tokens but no checkpoint was kept on it{past} "
             f"(retention_interval={options.retention_interval!r})")
    if hit.divergence_tokens:
        return (f"{start}; this request keeps one at {hit.divergence_tokens:,}, where it leaves the stored path, so "
                "the next prompt that shares these tokens hits there.")
    return (f"{start}; retention_interval='dense' or a multiple of block_size ({options.block_size}) such as "
            f"{4 * options.block_size} keeps checkpoints inside prompts, so prompts ending inside a stored one hit.")


def _new_tokens_detail(core: ReportSource, kv_tokens: int, block_size: int) -> str:
    if kv_tokens:
        return (f"the stored path ends at {kv_tokens:,} tokens and the prompt goes on; the hit reaches its end, and "
                "the tokens after it are stored for the next request.")
    if not core.store.num_kv_blocks:
        return "the cache holds nothing yet (a first request, or after clear()); this prompt is stored for the next."
    return (f"no stored prompt under this salt and these weights starts with this prompt's first {block_size} "
            "tokens; put the text prompts share first and keep it token for token the same (a date or an id in a "
            "system prompt changes every request).")


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def _size(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes:,} bytes"


def log_request(number: int, reports: list[HitReport]) -> None:
    """Log the reports of request ``number`` on :data:`HITS_LOGGER` at INFO, one line per row (when enabled)."""
    if not logger.isEnabledFor(logging.INFO):
        return
    for row, report in enumerate(reports):
        where = f"request {number}" + (f" row {row}" if len(reports) > 1 else "")
        logger.info("%s: %s", where, report)
