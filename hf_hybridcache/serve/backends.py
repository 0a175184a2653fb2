"""Where tokens come from: the continuous-batching engine over the prefix cache, or (the stock baseline of
``benchmarks/serve_multiturn.py``) one plain ``generate()`` at a time without any cache.

Both expose ``stream(prompt_ids, sampling, salt, images)``, an async iterator of :class:`Progress` (all generated ids
so far, after every token); closing it early (a client that went away) cancels the request and frees its place.
``images`` (None: a text prompt) is what a vision-language wrapper's processor returns for the prompt besides its
ids (:mod:`~hf_hybridcache.serve.image_chat`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator

import torch
from transformers import GenerationConfig
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's sampling: ``temperature`` 0 is greedy; ``seed`` None draws one. ``logprobs`` and
    ``prompt_logprobs``: score the generated and the prompt tokens with this many alternatives each (None: no scores;
    :mod:`~hf_hybridcache.engine.scoring`). ``grammar``: the :class:`~hf_hybridcache.structured.Grammar` the reply
    follows (None: free text). ``num_speculative_tokens``: draft tokens per step at most (None: the server's
    setting; 0: no speculation for this request)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: object = None
    num_speculative_tokens: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class Progress:
    """A request's state after a step: its generated ids so far, the prompt tokens the cache restored, whether it is
    done and why it failed (None: it did not); the scores of its generated and prompt tokens so far when asked."""

    token_ids: list[int]
    hit_tokens: int
    finished: bool
    error: str | None = None
    token_scores: list | None = None
    prompt_scores: list | None = None


class EngineBackend:
    """Requests go to a :class:`~hf_hybridcache.engine.ContinuousBatchingManager` of ``cache``.

    The manager samples (transformers' per-request temperature, top-k and top-p processors); a greedy request is
    top-k 1 at temperature 1, which keeps only the argmax. A request with a ``seed`` samples from its own generator,
    so it gets the same reply whatever runs beside it; the others share the engine's generator.

    Args:
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` of the served model.
        eos_token_ids: ids that end a reply.
        max_running_requests: requests in one batch at most.
        max_batch_tokens: tokens in one step at most.
        max_model_len: prompt + reply tokens of one request at most (None: what the model's positions and the
            memory allow).
        speculation: the engine's :class:`~hf_hybridcache.engine.Speculation` (None: no speculative steps).

    Attributes:
        num_speculative_tokens: the draft tokens a request may verify per step at most (0: it does not speculate).

    Raises:
        ValueError: ``max_model_len`` is over what the model and memory allow.
    """

    scores = True  # it returns logprobs (the engine scores tokens)

    def __init__(self, cache, eos_token_ids: list[int], max_running_requests: int = 32,
                 max_batch_tokens: int = 512, max_model_len: int | None = None, speculation=None) -> None:
        from .._compat.continuous_batching import ContinuousBatchingConfig

        vocab_size = cache.model.get_input_embeddings().num_embeddings
        # Values other than the processors' neutral ones make transformers build each processor; every request
        # then passes its own.
        generation_config = GenerationConfig(do_sample=True, temperature=0.5, top_k=1, top_p=0.5,
                                             eos_token_id=eos_token_ids, pad_token_id=0)
        batching = ContinuousBatchingConfig(per_request_processors=True, max_requests_per_batch=max_running_requests,
                                            max_batch_tokens=max_batch_tokens)
        self.cache, self.vocab_size, self.eos_token_ids = cache, vocab_size, eos_token_ids
        self.manager = cache.init_continuous_batching(generation_config, batching, speculation=speculation)
        self.num_speculative_tokens = 0 if speculation is None else speculation.num_speculative_tokens
        if max_model_len is not None:
            if max_model_len > self.manager.limits.max_request_tokens:
                raise ValueError(f"--max-model-len {max_model_len} is over what this model and memory allow "
                                 f"({self.manager.limits.max_request_tokens} tokens per request); lower it.")
            self.manager.limits = dataclasses.replace(self.manager.limits, max_request_tokens=max_model_len)
        self._ids = itertools.count()

    @property
    def max_request_tokens(self) -> int:
        return self.manager.limits.max_request_tokens

    def start(self) -> None:
        self.manager.start()

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=5.0)

    @property
    def healthy(self) -> bool:
        return self.manager.is_running() and self.manager.background_thread_status.fatal_error is None

    def load(self) -> tuple[int, int]:
        """Requests running and waiting now."""
        return self.manager.num_running, self.manager.num_waiting

    def speculation_stats(self):
        """The engine's :class:`~hf_hybridcache.engine.SpeculationStats` so far (None: it does not speculate, or it
        is not running)."""
        engine = self.manager.batch_processor
        return None if not self.num_speculative_tokens or engine is None else engine.speculator.stats

    async def stream(self, prompt_ids: list[int], sampling: Sampling, salt: str | None,
                     images: dict | None = None) -> AsyncIterator[Progress]:
        queue: asyncio.Queue = asyncio.Queue()
        request_id = f"serve-{next(self._ids)}"
        if sampling.greedy:
            kwargs = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        else:
            kwargs = {"temperature": float(sampling.temperature), "top_k": self.vocab_size,
                      "top_p": float(sampling.top_p)}
        if images is not None:
            kwargs["images"] = images
        added = self.manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=sampling.max_tokens,
                                         streaming=True, eos_token_id=self.eos_token_ids, cache_salt=salt,
                                         seed=None if sampling.greedy else sampling.seed, logprobs=sampling.logprobs,
                                         prompt_logprobs=sampling.prompt_logprobs, grammar=sampling.grammar,
                                         num_speculative_tokens=sampling.num_speculative_tokens, **kwargs)
        if added is None:
            yield Progress([], 0, True, "The engine is not running.")
            return
        self.manager.register_result_handler(request_id, queue.put_nowait)
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.is_finished()
                yield Progress(list(output.generated_tokens), output.hit_tokens, finished, output.error,
                               output.token_scores, output.prompt_scores)
        finally:
            if not finished:
                self.manager.cancel_request(request_id)


class SequentialBackend:
    """One plain ``generate()`` at a time, no cache: what serving a hybrid model with transformers gives without this
    package (the baseline). ``seed`` is honoured (the global torch RNG is seeded under the lock). It computes no
    logprobs: requests that ask for them get a 400."""

    scores = False
    num_speculative_tokens = 0  # it does not speculate

    def __init__(self, model, eos_token_ids: list[int], max_request_tokens: int = 32768) -> None:
        self.model, self.eos_token_ids, self.max_request_tokens = model, eos_token_ids, max_request_tokens
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    healthy = True

    def load(self) -> tuple[int, int]:
        return self.running, self.waiting

    def speculation_stats(self) -> None:
        return None

    async def stream(self, prompt_ids: list[int], sampling: Sampling, salt: str | None,
                     images: dict | None = None) -> AsyncIterator[Progress]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        future = loop.run_in_executor(None, self._generate, prompt_ids, sampling, queue, loop, cancelled, images)
        tokens: list[int] = []
        try:
            while True:
                token = await queue.get()
                if token is None:
                    break
                tokens.append(token)
                yield Progress(list(tokens), 0, False)
            error = None
            try:
                await future
            except Exception as problem:  # noqa: BLE001 - reported as this request's 500
                error = f"{type(problem).__name__}: {problem}"
            yield Progress(list(tokens), 0, True, error)
        finally:
            cancelled.set()

    def _generate(self, prompt_ids, sampling: Sampling, queue, loop, cancelled: threading.Event, images) -> None:
        streamer = _TokenStreamer(queue, loop)
        self.waiting += 1
        try:
            with self._lock, torch.no_grad():
                self.waiting, self.running = self.waiting - 1, 1
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                sample = {} if sampling.greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p,
                                                         top_k=0)
                if sampling.grammar is not None:
                    from ..structured import GrammarLogitsProcessor

                    sample["logits_processor"] = [GrammarLogitsProcessor(sampling.grammar)]
                device = self.model.get_input_embeddings().weight.device
                ids = torch.tensor([prompt_ids], device=device)
                images = {name: tensor.to(device) for name, tensor in (images or {}).items()}
                # Without a mask generate() masks every pad token id in the prompt, and a model can generate one
                # that the next turn sends back.
                self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=sampling.max_tokens,
                    do_sample=not sampling.greedy, eos_token_id=self.eos_token_ids, pad_token_id=0,
                    streamer=streamer, stopping_criteria=[_Cancelled(cancelled)], **sample, **images,
                )
        finally:
            self.running = 0
            loop.call_soon_threadsafe(queue.put_nowait, None)


class _TokenStreamer(BaseStreamer):
    """Hands each new token id to an asyncio queue (``generate()`` puts the prompt first, which is skipped)."""

    def __init__(self, queue: asyncio.Queue, loop) -> None:
        self.queue, self.loop, self.prompt_seen = queue, loop, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    """Ends ``generate()`` at the next token once the client went away."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)
