"""What ``add_request`` checks and makes: the engine requests of one call (a parent and its
``num_return_sequences - 1`` children), each failed with a sentence that says what to fix when the call is invalid
(empty prompt, ids outside the vocabulary, over the limits, bad sampling or scoring arguments, a grammar that cannot
end, images that do not fit the prompt)."""

from __future__ import annotations

import torch

from .._compat.continuous_batching import RequestStatus
from .generation_fields import EosFloor, new_tokens
from .grammar import grammar_error
from .images import request_images
from .requests import EngineRequest, first_eos_ids, validation_error
from .scoring import request_error
from .speculative import speculation_error


def new_requests(manager, input_ids, request_id: str, max_new_tokens: int | None, *, streaming: bool,
                 record_timestamps: bool, eos_token_id, cache_salt: str | None, seed: int | None,
                 logprobs: int | None, prompt_logprobs: int | None, grammar, images, sampling: dict,
                 num_speculative_tokens: int | None = None) -> list[EngineRequest]:
    """The requests of one :meth:`~hf_hybridcache.engine.ContinuousBatchingManager.add_request` call of ``manager``
    (its arguments, ``sampling`` its logits-processor kwargs; without a ``seed``, the one ``input_ids`` carries as an
    attribute, if any): children ``{request_id}__child#{k}`` first, the parent last. When the call is invalid every
    one has ``status=FAILED`` and the reason in ``error``."""
    model, config = manager.model, manager.generation_config
    seed = getattr(input_ids, "seed", None) if seed is None else seed  # a trainer's rollout carries its own seed
    vocab_size = model.get_input_embeddings().num_embeddings
    prompt = input_ids.reshape(-1).tolist() if isinstance(input_ids, torch.Tensor) else input_ids
    max_new_tokens, error = new_tokens(config, prompt, max_new_tokens)
    salt = cache_salt if cache_salt is not None else manager.salt
    error = error or validation_error(prompt, max_new_tokens, vocab_size, manager.limits.max_request_tokens, salt,
                                      seed, manager.num_return_sequences)
    error = error or request_error(logprobs, prompt_logprobs)
    error = error or speculation_error(num_speculative_tokens, manager.speculation)
    eos = first_eos_ids(eos_token_id, config.eos_token_id, model.config.get_text_config().eos_token_id)
    error = error or grammar_error(grammar, eos, EosFloor.of(model, config), vocab_size)
    if error is None:
        try:
            manager.processors.check_kwargs(sampling)
        except (TypeError, ValueError) as problem:
            error = f"Invalid sampling arguments: {problem}"
    request_images_ = None
    if error is None:
        request_images_, error = request_images(model, prompt, images)
    ids = [f"{request_id}__child#{k}" for k in range(manager.num_return_sequences - 1)] + [request_id]
    requests = [  # the parent (last) keeps the seed, child k gets seed + k + 1
        EngineRequest(rid, list(prompt) if error is None else [], max_new_tokens, eos, dict(sampling),
                      seed=None if error or seed is None else seed + (k + 1) % len(ids), salt=salt,
                      streaming=streaming, record_timestamps=record_timestamps, score_generated=logprobs,
                      score_prompt=prompt_logprobs, timestamps=[] if record_timestamps else None,
                      grammar=None if error or grammar is None else grammar.matcher(), images=request_images_,
                      num_speculative_tokens=num_speculative_tokens)
        for k, rid in enumerate(ids)
    ]
    if error is not None:
        for request in requests:
            request.status, request.error = RequestStatus.FAILED, error
    return requests
