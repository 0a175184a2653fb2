"""The manager: transformers' continuous-batching API (``ContinuousBatchingManager`` in
``generation/continuous_batching/continuous_api.py``, 5.23 - 5.24) over the engine, so ``model.generate_batch`` and
``model.continuous_batching_context_manager`` run on it (``transformers serve`` loads its own model: docs/serving.md).

Requests enter from any thread (:meth:`ContinuousBatchingManager.add_request`), run in one background thread (the
loop: take new requests and cancellations, run a step, deliver outputs), and leave as transformers'
``GenerationOutput`` (an :class:`~hf_hybridcache._compat.continuous_batching.EngineOutput`, which adds the
request's ``hit_tokens``) through :meth:`~ContinuousBatchingManager.get_result`,
:meth:`~ContinuousBatchingManager.request_id_iter` (streaming) or a handler
(:meth:`~ContinuousBatchingManager.register_result_handler`). A request is refused at once, with its error in its
output, when it is invalid; a step whose forward raises fails only the request that makes it raise (the others are
recomputed); the loop itself never dies of a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
import torch
from transformers import GenerationConfig

from .._compat.continuous_batching import (KEPT_ATTR, ContinuousBatchingConfig, GenerationOutput, RequestStatus,
                                           logits_processors)
from .._compat.engine_attention import install_router
from .engine import Engine
from .grouping import wrap_stateful_modules
from .limits import EngineLimits
from .generation_fields import EosFloor, batching_config, engine_generation_config
from .intake import new_requests
from .outputs import OutputRouter, ThreadStatus
from .requests import EngineRequest
from .runner import StepRunner
from .speculative import Speculation

logger = logging.getLogger("hf_hybridcache")

#: How long the idle loop sleeps between looks at its queues, in seconds.
IDLE_WAIT_S = 0.05


class ContinuousBatchingManager:
    """Serves requests for one :class:`~hf_hybridcache.HybridPrefixCache` with continuous batching.

    Made by ``cache.init_continuous_batching(...)`` or ``model.init_continuous_batching(...)`` (the cache installs
    the latter on its model), and used as transformers' manager::

        manager = model.init_continuous_batching(generation_config=GenerationConfig(max_new_tokens=64))
        manager.start()
        request_id = manager.add_request(prompt_ids, cache_salt="tenant-7")
        for output in manager.request_id_iter(request_id):   # streaming: add_request(..., streaming=True)
            print(output.generated_tokens, output.hit_tokens)
        manager.stop()

    Args:
        cache: the cache whose store, budget and options the requests share with ``generate()`` calls.
        generation_config: sampling and stopping; the model's fills the fields it leaves unset (as in generate()).
            The fields applied, allowed and refused: :mod:`~hf_hybridcache.engine.generation_fields`.
        continuous_batching_config: transformers' ``ContinuousBatchingConfig``: ``max_batch_tokens``,
            ``max_requests_per_batch``, ``max_memory_percent``, ``per_request_processors``, ``return_logprobs`` and
            ``seed`` are used (``page_size``: the cache's ``block_size``; no CUDA graphs); None: generation config's.
        limits: explicit :class:`~hf_hybridcache.engine.EngineLimits` (else from the device and the config).
        salt: the tenant salt of requests that pass no ``cache_salt`` (a salted view's own salt by default).
        speculation: speculative steps (:class:`~hf_hybridcache.engine.Speculation`; docs/speculative.md), or None.

    Attributes:
        background_thread_status: ``fatal_error`` is set if the loop ever dies (it does not for a request's fault).
        batch_processor: the running :class:`~hf_hybridcache.engine.engine.Engine` (``.scheduler.running`` and
            ``.scheduler.waiting`` the requests, ``.speculator.stats`` speculation's counts), or None when stopped.

    Raises:
        ValueError: flash attention (it cannot be masked per group), or a generation config field it refuses.
    """

    def __init__(
        self,
        cache,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
        *,
        limits: EngineLimits | None = None,
        salt: str | None = None, speculation: Speculation | None = None,
    ) -> None:
        model = cache.model
        generation_config = engine_generation_config(model, generation_config)  # before the model is touched
        install_router(model)
        wrap_stateful_modules(model)
        self.model, self.cache, self.salt, self.generation_config = model, cache, salt, generation_config
        self.speculation = speculation
        self.continuous_batching_config = config = batching_config(generation_config, continuous_batching_config)
        self.num_return_sequences = self.generation_config.num_return_sequences or 1
        self.limits = limits or EngineLimits.from_device(
            model, cache.spec, cache.max_cache_bytes, config.max_requests_per_batch, config.max_batch_tokens,
            memory_fraction=config.max_memory_percent,
        )
        self.processors = logits_processors(model, self.generation_config, config)
        self.background_thread_status = ThreadStatus()
        self.batch_processor: Engine | None = None
        self.warmed_up = False
        self._router = OutputRouter()
        self._inbox: queue.Queue[EngineRequest] = queue.Queue()
        self._intake = threading.Lock()  # held by add_requests while it queues, so the loop takes them together
        self._cancels: queue.Queue[str] = queue.Queue()
        self._wake = threading.Event()
        self._stop_mode: str | None = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    # ------------------------------------------------------------------ control

    def warmup(self) -> None:
        """Nothing to capture ahead (no CUDA graphs); kept for transformers' context manager."""
        self.warmed_up = True

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the loop thread (a no-op with a warning if it runs)."""
        if self.is_running():
            logger.warning("The continuous batching manager is already running.")
            return
        with torch.inference_mode(False):  # normal tensors: the loop thread, outside the mode, writes them in place
            self.batch_processor = Engine(self.cache, self.limits, _step_runner(self), self.speculation)
        self.background_thread_status = ThreadStatus()
        self._stop_mode = None
        self._thread = threading.Thread(target=self._run, args=(torch.get_num_threads(),), name="hf_hybridcache-engine",
                                        daemon=True)
        self._thread.start()

    def stop(self, block: bool = True, timeout: float | None = None, keep_for_next_session: bool = False,
             hard_stop: bool = False) -> None:
        """Stop the loop: accept no more requests, finish the running ones (``hard_stop``: fail them at once), and
        with ``block`` wait for the thread. After ``timeout`` seconds a flush becomes a hard stop, so a blocking
        call returns within one step of it. ``keep_for_next_session``: the model's ``init_continuous_batching``
        returns this manager next time."""
        if self._thread is None:
            return
        if self._stop_mode != "hard":
            self._stop_mode = "hard" if hard_stop else "flush"
        self._wake.set()
        if block:
            self._thread.join(timeout)
            if self._thread.is_alive():
                self._stop_mode = "hard"
                self._thread.join()
        if keep_for_next_session:
            vars(self.model)[KEPT_ATTR] = self

    def destroy(self) -> None:
        """Stop (failing what runs) and forget this manager if it was kept."""
        if self.is_running():
            self.stop(block=True, hard_stop=True)
        if vars(self.model).get(KEPT_ATTR) is self:
            del vars(self.model)[KEPT_ATTR]

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        input_ids,
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        eos_token_id: int | list[int] | None = None,
        cache_salt: str | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        grammar=None,
        images: Mapping[str, torch.Tensor] | None = None,
        num_speculative_tokens: int | None = None,
        **logit_processor_kwargs,
    ) -> str | None:
        """Queue a request; returns its id (None when the manager is stopping or dead, as transformers').

        Args:
            input_ids: the prompt's token ids (a list of ints, or a ``[T]`` / ``[1, T]`` tensor).
            request_id: its id (``req_<n>`` when None).
            max_new_tokens: tokens to generate at most (else as ``generate()``: the generation config's
                ``max_new_tokens``, else its ``max_length`` less the prompt's length, else 20).
            streaming: deliver an output after every token.
            record_timestamps: record when each token was generated.
            eos_token_id: token id(s) that end it (the generation config's, else the model's).
            cache_salt: the tenant salt of its prefix chains: it reuses only prefixes stored under the same salt
                (by ``generate()`` with ``cache.with_salt(salt)`` or by engine requests with that salt).
            seed: when sampling, the seed of this request's own generator, so it samples the same tokens whatever runs
                beside it (``num_return_sequences`` children: ``seed + 1``, ...). None: the shared generator.
            logprobs, prompt_logprobs: score its generated / prompt tokens, with this many alternatives (0-20 / 0-5).
            grammar: a :class:`~hf_hybridcache.structured.Grammar` its output (each sequence's) follows, or None.
            images: for a vision-language wrapper, what its processor returns for this one prompt besides
                ``input_ids`` / ``attention_mask`` (``processor(text=..., images=..., return_tensors="pt")``):
                ``pixel_values`` + ``image_grid_thw`` (Qwen3.5, LFM3-VL, Inkling 2), ``pixel_values`` +
                ``spatial_shapes`` + ``pixel_attention_mask`` (LFM2-VL), ``pixel_values`` + ``image_grid_hw``
                (Nemotron-H Omni), ``pixel_values`` (Inkling); ``mm_token_type_ids`` is taken and recomputed. The
                prompt is then looked up and stored by its images' content (:mod:`~hf_hybridcache.engine.images`).
            num_speculative_tokens: draft tokens it verifies per step at most, ``0 .. speculation.num_speculative_tokens``
                (None: the manager's ``speculation`` default; 0: it does not speculate).
            logit_processor_kwargs: per-request ``temperature``, ``top_k``, ``top_p`` (with
                ``ContinuousBatchingConfig(per_request_processors=True)`` and the processor enabled in the
                generation config).

        An invalid request (empty prompt, ids outside the vocabulary, over the limits, bad sampling kwargs, image
        placeholders and pixel inputs that disagree, inputs the cache cannot key such as audio) is not queued: its
        output, with ``status=FAILED`` and ``error`` saying what to fix, is delivered at once.
        """
        if self.background_thread_status.fatal_error is not None or self._stop_mode is not None:
            logger.warning("The continuous batching manager is stopping or stopped; the request is dropped.")
            return None
        request_id = f"req_{next(self._ids)}" if request_id is None else request_id
        requests = new_requests(
            self, input_ids, request_id, max_new_tokens, streaming=streaming, record_timestamps=record_timestamps,
            eos_token_id=eos_token_id, cache_salt=cache_salt, seed=seed, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, grammar=grammar, images=images, sampling=logit_processor_kwargs,
            num_speculative_tokens=num_speculative_tokens,
        )
        if requests[-1].error is not None:
            self._router.deliver([r.to_output() for r in requests])
            return request_id
        for request in requests:
            self._inbox.put(request)
        self._wake.set()
        return request_id

    def add_requests(self, inputs: list, max_new_tokens: int | None = None, streaming: bool = False,
                     record_timestamps: bool = False, images: list | None = None,
                     **logit_processor_kwargs) -> list[str]:
        """:meth:`add_request` for each prompt of ``inputs`` (with ``images[i]`` when given, one entry or None per
        prompt, else a prompt's own ``images`` as ``generate_batch(inputs, images=...)`` hands them on); returns
        their ids in order. The loop takes them in one go, so requests sent together start in the same step (equal
        chunks form one group)."""
        images = [getattr(ids, "images", None) for ids in inputs] if images is None else images
        with self._intake:
            return [
                self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming,
                                 record_timestamps=record_timestamps, images=prompt_images, **logit_processor_kwargs)
                for ids, prompt_images in zip(inputs, images, strict=True)
            ]

    def cancel_request(self, request_id: str) -> None:
        """Cancel a request (and its ``num_return_sequences`` children): its slot and pages are freed before the
        next step, and its output is delivered with ``status=FAILED`` and ``error="cancelled"``."""
        self._cancels.put(request_id)
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output (of ``request_id`` if given), waiting up to ``timeout`` seconds; None when there is none
        (at once when the loop is not running and nothing is queued)."""
        return self._router.get(request_id, timeout, self.is_running)

    def __iter__(self) -> Iterator[GenerationOutput]:
        while self.is_running():
            result = self.get_result(timeout=0.1)
            if result is not None:
                yield result

    def request_id_iter(self, request_id: str) -> Iterator[GenerationOutput]:
        """The outputs of ``request_id`` as they come (one per token when streaming), until its final one."""
        while True:
            result = self.get_result(request_id=request_id, timeout=0.1)
            if result is not None:
                yield result
                if result.is_finished():
                    return
            elif not self.is_running():
                return

    def register_result_handler(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Call ``callback(output)`` on the running asyncio event loop for each output of ``request_id`` (outputs
        delivered before registration included). Call from a coroutine."""
        self._router.register(request_id, callback, asyncio.get_running_loop())

    @property
    def num_running(self) -> int:
        """Requests admitted now (the server's gauge of running requests)."""
        return 0 if self.batch_processor is None else len(self.batch_processor.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued or waiting for admission now (the server's gauge of waiting requests)."""
        waiting = 0 if self.batch_processor is None else len(self.batch_processor.scheduler.waiting)
        return waiting + self._inbox.qsize()

    # ------------------------------------------------------------------ the loop

    def _run(self, threads: int) -> None:
        # The starting thread's intra-op thread count, set here: left to torch's lazy per-thread start, this thread's
        # first prefill could run its matrix products on one thread (a 1,024-token prefill at half speed).
        torch.set_num_threads(threads)
        engine = self.batch_processor
        error: BaseException | None = None
        try:
            with torch.no_grad():
                while self._stop_mode != "hard":
                    engine.flushing = self._stop_mode is not None  # stopping: reply replays run at once
                    if engine.flushing and not engine.has_work and self._inbox.empty():
                        break
                    # One iteration passes the cache's call gate as a generate() call does: clear(), save() and
                    # budget changes wait for its end, so the store never changes under a step (and refuse to run
                    # from this thread, from code the step calls back: core.calls).
                    with self.cache.core.engine_scope():
                        engine.follow_store()
                        cancelled = self._take_queues(engine)
                        changed = engine.step() if engine.has_work else None
                    self._deliver(cancelled + (changed or []))
                    if changed is None:
                        self._wake.wait(IDLE_WAIT_S)
                        self._wake.clear()
        except BaseException as problem:  # noqa: BLE001 - recorded for serve, every request is failed below
            error = problem
            self.background_thread_status.fatal_error = problem
            logger.exception("the continuous batching loop died")
        finally:
            reason = "stopped" if error is None else f"the engine loop died: {error!r}"
            try:
                with self.cache.core.engine_scope():
                    self._deliver(self._take_queues(engine) + engine.abort(reason))
            finally:
                self._router.wake()

    def _take_queues(self, engine: Engine) -> list[EngineRequest]:
        """Queue the new requests and end the cancelled ones (returned, for delivery)."""
        with self._intake:
            while not self._inbox.empty():  # the loop is the queues' only reader: a non-empty one has an item for it
                engine.add(self._inbox.get_nowait())
        cancelled = []
        while not self._cancels.empty():
            request_id = self._cancels.get_nowait()
            for request in [r for r in (*engine.scheduler.running, *engine.scheduler.waiting)
                            if r.request_id == request_id or r.request_id.startswith(f"{request_id}__child#")]:
                engine.finish(request, RequestStatus.FAILED, "cancelled")
                cancelled.append(request)
        return cancelled

    def _deliver(self, requests: list[EngineRequest]) -> None:
        outputs = [r.to_output() for r in requests if (r.is_finished or r.streaming) and not r.replay_of]
        for request_id in self._router.deliver(outputs) if outputs else ():  # their readers' event loops closed
            self.cancel_request(request_id)


def _step_runner(manager: ContinuousBatchingManager) -> StepRunner:
    """The step runner of ``manager``'s engine (its sampling, logprobs and seed settings)."""
    config = manager.continuous_batching_config
    return StepRunner(manager.model, manager.processors, bool(manager.generation_config.do_sample),
                      config.return_logprobs, config.seed, EosFloor.of(manager.model, manager.generation_config))
