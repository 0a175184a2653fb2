"""Running one request's ``n`` choices on a backend: text pieces as tokens arrive, finish reasons, latencies into the
metrics, and the reply ids remembered for the conversation's next turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from .backends import Sampling
from .schema import APIError
from .text import TextStream


@dataclass
class Piece:
    """New text of choice ``index``; ``finish_reason`` set on its last piece. ``token_ids`` are the tokens generated
    since the previous piece (an ending EOS left out) and ``scores`` their scores, when the request asked for
    logprobs; the first piece that has them carries ``prompt_scores`` (its prompt tokens', when asked)."""

    index: int
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    hit_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    scores: list | None = None
    prompt_scores: list | None = None


@dataclass(frozen=True)
class Job:
    """What a request asks of one prompt: its ids, sampling (``max_tokens`` 0: score the prompt, generate nothing),
    stop strings, tenant salt and number of choices."""

    prompt_ids: list[int]
    sampling: Sampling
    stop: list[str]
    salt: str | None
    n: int = 1
    remember: bool = False  # keep the reply's ids (chat: the next turn sends the reply back)
    images: dict | None = None  # the prompt's image inputs (serve/image_chat.py), None for a text prompt
    images_key: bytes = b""  # what names the prompt's images in the reply memory


class ChoiceRunner:
    """Runs jobs on ``backend`` (see :mod:`~hf_hybridcache.serve.backends`) for one server."""

    def __init__(self, backend, tokenizer, metrics, memory, eos_token_ids: list[int]) -> None:
        self.backend, self.tokenizer, self.metrics, self.memory = backend, tokenizer, metrics, memory
        self.eos_token_ids = set(eos_token_ids)

    async def pieces(self, jobs: list[Job], arrived: float) -> AsyncIterator[Piece]:
        """The pieces of every choice of every job, interleaved as they come; choice ``k`` of job ``j`` is numbered
        ``k`` plus the choices of the jobs before it (as OpenAI numbers a completion's prompts and their ``n``).

        Raises:
            APIError: 500 when the backend fails a choice (the others are cancelled).
        """
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(job: Job, k: int, index: int) -> None:
            try:
                async for piece in self._choice(job, k, index, arrived):
                    await queue.put(piece)
            except APIError as problem:
                await queue.put(problem)
            finally:
                await queue.put(done)

        starts = choice_offsets(jobs)
        tasks = [asyncio.create_task(pump(job, k, start + k)) for job, start in zip(jobs, starts) for k in range(job.n)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, APIError):
                    raise item
                else:
                    yield item
        finally:  # a client that went away (or a failed choice) cancels what still runs
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _choice(self, job: Job, k: int, index: int, arrived: float) -> AsyncIterator[Piece]:
        sampling = job.sampling
        if sampling.seed is not None and k:
            sampling = replace(sampling, seed=sampling.seed + k)
        if sampling.max_tokens == 0:  # score the prompt: one token is generated (the engine's least) and dropped
            async for piece in self._scored(job, replace(sampling, max_tokens=1), index):
                yield piece
            return
        text = TextStream(self.tokenizer, job.stop)
        stream = self.backend.stream(job.prompt_ids, sampling, job.salt, job.images)
        last, seen, given, prompt_given = arrived, 0, 0, False

        def piece(delta: str, finish: str | None = None, end: int | None = None) -> Piece:
            """A piece with the tokens (and scores) since the last one, up to ``end`` (None: all so far)."""
            nonlocal given, prompt_given
            ids = progress.token_ids
            end = len(ids) if end is None else end
            scores = None if progress.token_scores is None else progress.token_scores[given:end]
            prompt = None if prompt_given else progress.prompt_scores
            out = Piece(index, delta, finish, seen, progress.hit_tokens, ids[given:end], scores, prompt)
            given, prompt_given = end, prompt_given or prompt is not None
            return out

        try:
            async for progress in stream:
                if progress.error is not None:
                    raise APIError(500, f"Generation failed: {progress.error}")
                now, new = time.perf_counter(), len(progress.token_ids) - seen
                if new > 0:
                    self._observe_latency(now - last, new, first=seen == 0)
                    last, seen = now, len(progress.token_ids)
                    self.metrics.generation_tokens.inc(new)
                delta = text.update(progress.token_ids, progress.finished)
                if text.stopped:  # usage counts the tokens up to the stop string's, however many came at once
                    seen = text.stop_tokens
                    yield piece(delta, "stop", seen)
                    return
                if progress.finished:
                    ids = progress.token_ids
                    ended = bool(ids) and ids[-1] in self.eos_token_ids
                    if job.remember:
                        self.memory.remember(job.salt, job.prompt_ids, text.sent, ids[:-1] if ended else ids,
                                             job.images_key)
                    yield piece(delta, "stop" if ended else "length", len(ids) - 1 if ended else None)
                    return
                if delta:
                    yield piece(delta)
        finally:
            await stream.aclose()

    def _observe_latency(self, elapsed_s: float, num_tokens: int, first: bool) -> None:
        """Observe ``num_tokens`` tokens that arrived together ``elapsed_s`` after the last ones (or after the
        request, ``first``): the time to the first token once, and one time per output token for each later token,
        so the histogram counts tokens, not arrivals, and its mean is the time per token (a speculative step brings
        several tokens at once: each is observed at its share of the gap; those that came with the first at 0)."""
        if first:
            self.metrics.ttft.observe(elapsed_s)
            num_tokens, elapsed_s = num_tokens - 1, 0.0
        for _ in range(num_tokens):
            self.metrics.token_latency.observe(elapsed_s / num_tokens)

    async def _scored(self, job: Job, sampling: Sampling, index: int) -> AsyncIterator[Piece]:
        """The one piece of a choice that scores its prompt and generates nothing (``max_tokens`` 0)."""
        stream = self.backend.stream(job.prompt_ids, sampling, job.salt, job.images)
        try:
            async for progress in stream:
                if progress.error is not None:
                    raise APIError(500, f"Scoring failed: {progress.error}")
                if progress.finished:
                    yield Piece(index, "", "length", 0, progress.hit_tokens, [], [], progress.prompt_scores)
                    return
        finally:
            await stream.aclose()


def choice_offsets(jobs: list[Job]) -> list[int]:
    """The number of each job's first choice: the choices of the jobs before it."""
    starts, total = [], 0
    for job in jobs:
        starts.append(total)
        total += job.n
    return starts
