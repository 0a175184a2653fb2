"""Running one request's ``n`` choices on a backend: text pieces as tokens arrive, finish reasons, latencies into the
metrics, and the reply ids remembered for the conversation's next turn."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from .backends import Sampling
from .schema import APIError
from .text import TextStream


@dataclass
class Piece:
    """New text of choice ``index``; ``finish_reason`` set on its last piece."""

    index: int
    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    hit_tokens: int = 0


@dataclass(frozen=True)
class Job:
    """What a request asks: its prompt ids, sampling, stop strings, tenant salt and number of choices."""

    prompt_ids: list[int]
    sampling: Sampling
    stop: list[str]
    salt: str | None
    n: int = 1
    remember: bool = False  # keep the reply's ids (chat: the next turn sends the reply back)


class ChoiceRunner:
    """Runs jobs on ``backend`` (see :mod:`~hf_hybridcache.serve.backends`) for one server."""

    def __init__(self, backend, tokenizer, metrics, memory, eos_token_ids: list[int]) -> None:
        self.backend, self.tokenizer, self.metrics, self.memory = backend, tokenizer, metrics, memory
        self.eos_token_ids = set(eos_token_ids)

    async def pieces(self, job: Job, arrived: float) -> AsyncIterator[Piece]:
        """The pieces of every choice, interleaved as they come.

        Raises:
            APIError: 500 when the backend fails a choice (the others are cancelled).
        """
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            try:
                async for piece in self._choice(job, index, arrived):
                    await queue.put(piece)
            except APIError as problem:
                await queue.put(problem)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(index)) for index in range(job.n)]
        try:
            remaining = job.n
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

    async def _choice(self, job: Job, index: int, arrived: float) -> AsyncIterator[Piece]:
        sampling = job.sampling
        if sampling.seed is not None and index:
            sampling = Sampling(sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed + index)
        text = TextStream(self.tokenizer, job.stop)
        stream = self.backend.stream(job.prompt_ids, sampling, job.salt)
        last, seen = arrived, 0
        try:
            async for progress in stream:
                if progress.error is not None:
                    raise APIError(500, f"Generation failed: {progress.error}")
                now, new = time.perf_counter(), len(progress.token_ids) - seen
                if new > 0:
                    histogram = self.metrics.ttft if seen == 0 else self.metrics.token_latency
                    histogram.observe(now - last if seen == 0 else (now - last) / new)
                    last, seen = now, len(progress.token_ids)
                    self.metrics.generation_tokens.inc(new)
                delta = text.update(progress.token_ids, progress.finished)
                if text.stopped:
                    yield Piece(index, delta, "stop", seen, progress.hit_tokens)
                    return
                if progress.finished:
                    ids = progress.token_ids
                    ended = bool(ids) and ids[-1] in self.eos_token_ids
                    if job.remember:
                        self.memory.remember(job.salt, job.prompt_ids, text.sent, ids[:-1] if ended else ids)
                    yield Piece(index, delta, "stop" if ended else "length", seen, progress.hit_tokens)
                    return
                if delta:
                    yield Piece(index, delta)
        finally:
            await stream.aclose()
