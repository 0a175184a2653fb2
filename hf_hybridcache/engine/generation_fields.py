"""Which ``GenerationConfig`` fields the engine applies, which it allows because they cannot change a token, and
which it refuses: a config that sets a field the engine does not apply is refused with a ``ValueError`` naming
each such field, so that no field is ever dropped silently.

As in ``generate()``, the model's ``generation_config`` fills the fields a given config leaves unset, so a field the
model's config sets counts too. A field is *set* when its value differs both from a default ``GenerationConfig()``'s
and from its off value in :data:`OFF` (the value at which ``generate()`` does nothing with it, which checkpoints
often save: ``num_beams: 1``, ``repetition_penalty: 1.0``). Fields are those of the installed transformers' default
``GenerationConfig()``, so one that a later version adds is refused until it is listed here.

Applied, as ``generate()`` applies them (:data:`APPLIED`): ``max_new_tokens`` and ``max_length`` (a request's
``max_new_tokens`` when it passes none: :func:`new_tokens`), ``min_new_tokens`` and ``min_length``
(:class:`EosFloor`), ``do_sample``, ``temperature``, ``top_k`` (50 when sampling and unset, ``generate()``'s
default) and ``top_p`` (transformers' continuous-batching processors, also per request), ``suppress_tokens``
(transformers' processor: it reads the scores alone), ``eos_token_id`` (per request too), ``num_return_sequences``
and ``continuous_batching_config`` (the manager's when it is given none, as transformers' ``init_continuous_batching``).

Allowed, for the reason given in :data:`ALLOWED`: ids the engine never uses (``pad_token_id``, ``bos_token_id``,
``decoder_start_token_id``), how ``generate()`` runs rather than what it computes (``use_cache``, ``compile_config``,
``disable_compile``, ``prefill_chunk_size``), fields read only by beam search or an assistant model (neither of which
the engine runs, and whose switches are refused) and metadata (``transformers_version``, ``_from_model_config``).

Refused when set: every other field, among them ``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``,
``sequence_bias``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``, ``top_h``, ``num_beams``,
``stop_strings``, ``max_time``, ``forced_bos_token_id``, ``forced_eos_token_id``, ``begin_suppress_tokens``,
``exponential_decay_length_penalty``, ``guidance_scale``, ``watermarking_config``, ``renormalize_logits``,
``remove_invalid_values``, ``output_scores``, ``output_logits``, ``return_dict_in_generate``,
``cache_implementation`` and ``prompt_lookup_num_tokens``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from .._compat.continuous_batching import ContinuousBatchingConfig
from .requests import first_eos_ids

#: Fields the engine applies as ``generate()`` does.
APPLIED = frozenset({
    "max_new_tokens", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k", "top_p",
    "suppress_tokens", "eos_token_id", "num_return_sequences", "continuous_batching_config", "max_length",
})

#: Fields allowed at any value, and why none of them can change a token the engine samples.
ALLOWED = {
    "pad_token_id": "the engine never pads: each request runs unpadded in a packed step",
    "bos_token_id": "generate() uses it only when it gets no prompt; every engine request has one",
    "decoder_start_token_id": "only encoder-decoder models read it",
    "use_cache": "the engine always keeps its paged cache; the tokens are the same without one",
    "compile_config": "how generate() compiles its forward, not what it computes",
    "disable_compile": "how generate() compiles its forward, not what it computes",
    "prefill_chunk_size": "how generate() splits its prefill; the engine splits by max_batch_tokens",
    "length_penalty": "read by beam search only (num_beams > 1 is refused)",
    "early_stopping": "read by beam search only (num_beams > 1 is refused)",
    "num_assistant_tokens": "read only with an assistant model, which the engine does not take",
    "num_assistant_tokens_schedule": "read only with an assistant model, which the engine does not take",
    "assistant_confidence_threshold": "read only with an assistant model, which the engine does not take",
    "assistant_lookbehind": "read only with an assistant model, which the engine does not take",
    "target_lookbehind": "read only with an assistant model, which the engine does not take",
    "max_matching_ngram_size": "read only by prompt lookup (prompt_lookup_num_tokens is refused)",
    "transformers_version": "metadata",
    "_from_model_config": "metadata",
}

#: Values at which ``generate()`` does nothing with a field (allowed, though the engine does not apply the field).
OFF = {
    "num_beams": 1, "num_beam_groups": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "guidance_scale": 1.0, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "diversity_penalty": 0.0, "renormalize_logits": False,
    "remove_invalid_values": False, "output_attentions": False, "output_hidden_states": False,
    "output_scores": False, "output_logits": False, "return_dict_in_generate": False, "low_memory": False,
    "token_healing": False, "is_assistant": False, "use_mtp": False,
}

#: ``generate()``'s ``top_k`` when sampling and the config sets none, and its new tokens when the config sets neither
#: ``max_new_tokens`` nor ``max_length`` (transformers' ``_get_default_generation_params``: ``max_length`` 20, counted
#: from the prompt's end when it is the default).
DEFAULT_TOP_K, DEFAULT_NEW_TOKENS = 50, 20


def engine_generation_config(model, generation_config: GenerationConfig | None) -> GenerationConfig:
    """The config the engine runs for ``generation_config`` (the model's when None): a copy, with the model's
    ``generation_config`` filling the fields it leaves unset and ``generate()``'s default ``top_k`` when sampling.

    Raises:
        ValueError: it sets a field the engine does not apply (each one named; see the module's lists).
    """
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    if generation_config is not None:
        config.update(**model.generation_config.to_dict(), defaults_only=True)
    refused = refused_fields(config)
    if refused:
        raise ValueError(
            f"The continuous-batching engine does not apply these generation config fields: {', '.join(refused)}. "
            "It would drop them, and generate() applies them; unset them (or set their off value) in the "
            "generation_config given to generate_batch / init_continuous_batching, or in the model's "
            f"generation_config, which fills unset fields, or run generate(). Applied: {', '.join(sorted(APPLIED))}."
        )
    if config.do_sample and config.top_k is None:
        config.top_k = DEFAULT_TOP_K
    return config


def refused_fields(config: GenerationConfig) -> list[str]:
    """``field=value`` for each field ``config`` sets that the engine does not apply, in field order."""
    refused = []
    for name, default in GenerationConfig().to_dict().items():
        value = getattr(config, name, default)
        if name in ALLOWED or value == default or (name in OFF and value == OFF[name]):
            continue
        if name == "continuous_batching_config" and not isinstance(value, ContinuousBatchingConfig):
            refused.append(f"continuous_batching_config={value!r} (not a ContinuousBatchingConfig)")
        elif name not in APPLIED:
            refused.append(f"{name}={value!r}")
    return refused


def new_tokens(config: GenerationConfig, prompt, max_new_tokens: int | None) -> tuple[int, str | None]:
    """A request's ``max_new_tokens`` and, when there is none it can run with, why: the one it passes, else as
    ``generate()`` computes it from ``config``: its ``max_new_tokens``, else its ``max_length`` (prompt included) less
    the prompt's length, which must leave one token (``generate()`` raises otherwise), else 20."""
    if max_new_tokens is not None or config.max_new_tokens is not None:
        return (max_new_tokens if max_new_tokens is not None else config.max_new_tokens), None
    if config.max_length is None:
        return DEFAULT_NEW_TOKENS, None
    length = len(prompt) if hasattr(prompt, "__len__") and not isinstance(prompt, (str, bytes)) else 0
    if length >= config.max_length:
        return 0, (f"The prompt ({length} tokens) reaches the generation config's max_length ({config.max_length}), "
                   "which counts the prompt; pass max_new_tokens, or raise max_length.")
    return config.max_length - length, None


def batching_config(
    generation_config: GenerationConfig, continuous_batching_config: ContinuousBatchingConfig | None
) -> ContinuousBatchingConfig:
    """The manager's ``ContinuousBatchingConfig``: the one given, else the generation config's (deprecated there, but
    transformers' ``init_continuous_batching`` still reads it), else the default."""
    if continuous_batching_config is not None:
        return continuous_batching_config
    given = generation_config.continuous_batching_config
    return given if isinstance(given, ContinuousBatchingConfig) else ContinuousBatchingConfig()


@dataclass(frozen=True)
class EosFloor:
    """``min_new_tokens`` and ``min_length`` as ``generate()`` applies them (transformers'
    ``MinNewTokensLengthLogitsProcessor`` and ``MinLengthLogitsProcessor``): the end-of-sequence ids' logits are -inf
    until a request has generated ``min_new_tokens`` tokens and holds ``min_length`` tokens, prompt included. Each
    request counts its own tokens. The ids held off are the generation config's end-of-sequence ids (else the
    model's), as ``generate()`` with that config holds off, and the request's own (``add_request(eos_token_id=...)``),
    so that it cannot end earlier either.

    Attributes:
        min_new_tokens: new tokens before an end-of-sequence id may be sampled.
        min_length: tokens (prompt and new) before an end-of-sequence id may be sampled.
        eos_token_ids: the generation config's end-of-sequence ids (else the model's); negative ids dropped.
    """

    min_new_tokens: int
    min_length: int
    eos_token_ids: frozenset[int]

    @classmethod
    def of(cls, model, config: GenerationConfig) -> EosFloor | None:
        """The floor of ``config`` (an :func:`engine_generation_config`), or None when it sets neither field.
        ``min_new_tokens`` takes precedence over ``min_length``, as in ``generate()`` (which then sets ``min_length``
        to ``min_new_tokens`` plus the prompt's length)."""
        min_new_tokens = config.min_new_tokens or 0
        min_length = 0 if config.min_new_tokens is not None else config.min_length or 0
        if not (min_new_tokens or min_length):
            return None
        eos = first_eos_ids(config.eos_token_id, model.config.get_text_config().eos_token_id)
        return cls(min_new_tokens, min_length, eos)

    def apply(self, logits: torch.Tensor, requests: list, ahead: list[int] | None = None) -> torch.Tensor:
        """``logits`` ``[M, V]`` float32 of ``requests`` (one :class:`~hf_hybridcache.engine.requests.EngineRequest`
        per row, about to sample its next token, ``ahead[row]`` tokens after its last: the draft tokens before a
        verified position), with the held-off ids of each row still under its floor at -inf."""
        mask = None
        for row, request in enumerate(requests):
            more = ahead[row] if ahead is not None else 0
            if len(request.generated) + more >= self.min_new_tokens and len(request.tokens) + more >= self.min_length:
                continue
            ids = [i for i in self.eos_token_ids | request.eos_token_ids if i < logits.shape[-1]]
            if ids:
                mask = torch.zeros_like(logits, dtype=torch.bool) if mask is None else mask
                mask[row, ids] = True
        return logits if mask is None else logits.masked_fill(mask, float("-inf"))
