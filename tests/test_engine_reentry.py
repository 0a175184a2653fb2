"""Cache operations called from code the engine runs in its own thread, inside a step (issue 43): a logits processor,
a forward hook, a grammar matcher (the engine's per-request stopping rule: a complete grammar allows only an
end-of-sequence token) and the vision tower (run when a request with images is admitted). ``clear()``, ``save()`` and budget changes waited for the step to end, so the engine hung
for good; ``generate()`` with the cache ran a whole call inside the step. Each now raises ``RuntimeError`` at once,
saying what to do; ``reset()`` and ``load()`` (a new cache) wait for nothing the step holds and run. An output
callback runs on its own event loop, not in the engine's thread: ``clear()`` there runs between two steps. A handler
whose event loop closed no longer ends the engine's thread, and a busy event loop is woken once for all the outputs
it has not run yet.

Each test waits for its outputs with a timeout, so the old hang is a failure, not a stuck run."""

import asyncio
import time

import pytest
import torch
from engine_scenarios import alone, config, finals, ids

from hf_hybridcache import HybridPrefixCache, _compat
from hf_hybridcache.core import check_store

NEW_TOKENS = 6
TIMEOUT_S = 30  # every step here takes milliseconds; the old code never answered
PROMPT = ids(40, seed=4300)
STEP_ERROR = "cannot run inside a step of the continuous-batching engine"
GENERATE_ERROR = "cannot run inside a step of its continuous-batching engine"


def operations(cache, model, path):
    """name -> (the call, what it does from inside a step: the error it raises, or None: it runs)."""
    prompt, kwarg = torch.tensor([ids(20, seed=4301)]), _compat.cache_kwarg(model)

    def generate(view):
        return lambda: model.generate(prompt, max_new_tokens=2, do_sample=False, **{kwarg: view})

    return {
        "clear": (cache.clear, STEP_ERROR),
        "save": (lambda: cache.save(path), STEP_ERROR),
        "budget": (lambda: setattr(cache, "max_cache_bytes", cache.max_cache_bytes // 2), STEP_ERROR),
        "generate": (generate(cache), GENERATE_ERROR),
        "generate on a view": (generate(cache.with_salt("t")), GENERATE_ERROR),
        "reset": (cache.reset, None),
        "load": (lambda: HybridPrefixCache.load(path, model), None),
    }


class Once:
    """Runs ``call`` the first time it is called and records what it raised (or None)."""

    def __init__(self, call) -> None:
        self.call, self.outcome = call, []

    def __call__(self) -> None:
        if self.outcome:
            return
        try:
            self.call()
        except RuntimeError as error:
            self.outcome.append(error)
        else:
            self.outcome.append(None)


def check_after(manager, cache, cold_model, output) -> None:
    """The request equals itself alone, the manager serves on, and clear() works between steps."""
    assert output.error is None and output.generated_tokens == alone(cold_model, PROMPT, NEW_TOKENS, eos_token_id=-1)
    again = manager.add_request(ids(30, seed=4302))
    assert finals(manager, [again], timeout=TIMEOUT_S)[again].error is None
    manager.stop()
    assert manager.background_thread_status.fatal_error is None and cache.core.engine_threads == set()
    cache.clear()
    check_store(cache)


@pytest.mark.parametrize("family", ["jamba"])
@pytest.mark.parametrize("operation", ["clear", "save", "budget", "generate", "generate on a view", "reset", "load"])
def test_an_operation_from_a_logits_processor(family, operation, model, cold_model, tmp_path):
    cache = HybridPrefixCache(model)
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    call, error = operations(cache, model, path)[operation]
    once = Once(call)

    class Processor:
        def __call__(self, input_ids, scores):
            once()
            return scores

    manager = cache.init_continuous_batching(config(NEW_TOKENS, eos_token_id=-1))
    manager.processors.logits_processor.append(Processor())
    manager.processors.do_processing = True
    manager.start()
    request_id = manager.add_request(PROMPT)
    output = finals(manager, [request_id], timeout=TIMEOUT_S)[request_id]
    assert len(once.outcome) == 1
    if error is None:
        assert once.outcome == [None]
    else:
        assert error in str(once.outcome[0]) and "from another thread" in str(once.outcome[0])
    check_after(manager, cache, cold_model, output)


class ClearingMatcher:
    """A grammar matcher that allows every token and calls ``once`` at its mask."""

    def __init__(self, vocab_size: int, once: Once) -> None:
        self.vocab_size, self.once, self.tokens = vocab_size, once, []

    def fill(self, bitmask, row: int) -> None:
        self.once()

    def accept(self, token: int) -> bool:
        self.tokens.append(token)
        return True

    def try_accept(self, token: int) -> bool:  # with speculation: masks verified positions too
        return self.accept(token)

    def rollback(self, num_tokens: int) -> None:
        del self.tokens[len(self.tokens) - num_tokens:]


class ClearingGrammar:
    eos_token_ids = frozenset()

    def __init__(self, vocab_size: int, once: Once) -> None:
        self.vocab_size, self.once = vocab_size, once

    def matcher(self) -> ClearingMatcher:
        return ClearingMatcher(self.vocab_size, self.once)


@pytest.mark.parametrize("family", ["jamba", "qwen3_5_text"])
@pytest.mark.parametrize("where", ["forward hook", "grammar"])
def test_clear_from_code_inside_a_step_raises_at_once(family, where, model, cold_model):
    cache = HybridPrefixCache(model)
    once = Once(cache.clear)
    manager = cache.init_continuous_batching(config(NEW_TOKENS, eos_token_id=-1))
    manager.start()
    if where == "forward hook":
        handle = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: once())
        request_id = manager.add_request(PROMPT)
    else:
        handle = None
        grammar = ClearingGrammar(model.get_input_embeddings().num_embeddings, once)
        request_id = manager.add_request(PROMPT, grammar=grammar)
    try:
        output = finals(manager, [request_id], timeout=TIMEOUT_S)[request_id]
    finally:
        if handle is not None:
            handle.remove()
    assert STEP_ERROR in str(once.outcome[0]) and "clear()" in str(once.outcome[0])
    check_after(manager, cache, cold_model, output)


@pytest.mark.parametrize("family", ["jamba"])
def test_clear_from_an_output_callback_runs_between_two_steps(family, model, cold_model):
    """A result handler runs on its event loop, not in the engine's thread: clear() there waits for the step that
    runs, then empties the store, and the request goes on exactly."""
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(NEW_TOKENS, eos_token_id=-1))
    manager.start()
    once, stored_after = Once(cache.clear), []

    async def read() -> object:
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = manager.add_request(PROMPT, streaming=True)

        def handler(output):
            if not once.outcome:
                once()
                stored_after.append(cache.stored_bytes)
            outputs.put_nowait(output)

        manager.register_result_handler(request_id, handler)
        while not (output := await asyncio.wait_for(outputs.get(), TIMEOUT_S)).is_finished():
            pass
        return output

    output = asyncio.run(read())
    assert once.outcome == [None] and stored_after == [0]
    check_after(manager, cache, cold_model, output)


@pytest.mark.parametrize("family", ["jamba"])
def test_a_result_handler_whose_event_loop_closed_does_not_end_the_engine(family, model, cold_model):
    """Its reader went away (the ``asyncio.run`` that registered it returned): its request is cancelled, and the engine
    serves on (before: the closed loop's RuntimeError ended the engine's thread and failed every request)."""
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(200, eos_token_id=-1))
    manager.start()
    others = manager.add_requests([ids(30, seed=4303 + i) for i in range(2)])

    async def read_one() -> None:
        request_id = manager.add_request(PROMPT, streaming=True, request_id="gone")
        manager.register_result_handler(request_id, lambda output: None)

    asyncio.run(read_one())  # returns at once: its loop is closed before the request's first token
    outputs = finals(manager, others, timeout=TIMEOUT_S * 4)
    assert manager.background_thread_status.fatal_error is None and manager.is_running()
    assert all(output.error is None and len(output.generated_tokens) == 200 for output in outputs.values())
    assert manager.batch_processor.find("gone") is None  # cancelled, its slot given back
    manager.stop()
    check_store(cache)


class CountingLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the wake-ups other threads ask of it."""

    wakes = 0

    def call_soon_threadsafe(self, *args, **kwargs):
        self.wakes += 1
        return super().call_soon_threadsafe(*args, **kwargs)


@pytest.mark.parametrize("family", ["jamba"])
def test_a_busy_event_loop_is_woken_once_for_the_outputs_it_has_not_run(family, model, cold_model):
    """A streamed request's outputs that arrive while its handler's loop is busy join the wake-up already pending
    (each wake-up is a write to the loop's self-pipe from the engine's thread), and reach the handler in order."""
    cache = HybridPrefixCache(model)
    manager = cache.init_continuous_batching(config(NEW_TOKENS, eos_token_id=-1))
    manager.start()
    loop, seen = CountingLoop(), []

    async def read() -> None:
        finished = loop.create_future()

        def on_output(output) -> None:
            seen.append(list(output.generated_tokens))
            if output.is_finished():
                finished.set_result(output)

        request_id = manager.add_request(PROMPT, streaming=True, request_id="busy")
        manager.register_result_handler(request_id, on_output)
        deadline = time.monotonic() + TIMEOUT_S
        while manager.batch_processor.find(request_id) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop is busy: it runs nothing while the engine generates every token
        time.sleep(0.1)
        await asyncio.wait_for(finished, TIMEOUT_S)

    try:
        loop.run_until_complete(read())
    finally:
        loop.close()
        manager.stop()
    # one output per step, in order: a token each, or several where the step verified drafts ([spec] runs)
    lengths = [len(tokens) for tokens in seen]
    assert lengths[-1] == NEW_TOKENS and lengths == sorted(set(lengths)) and lengths[0] >= 1, lengths
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(seen, seen[1:]))
    assert loop.wakes <= 2, loop.wakes  # one per step (6 without speculation) before


def test_clear_from_the_vision_tower_raises_at_once():
    """The tower runs in the engine's thread when a request with images is admitted, inside the step."""
    from hf_hybridcache.toy.vision import build_vlm, toy_image, vision_tower, vlm_inputs

    model = build_vlm("qwen3_5", seed=5)
    cache = HybridPrefixCache(model)
    once = Once(cache.clear)
    inputs = vlm_inputs("qwen3_5", ["<|user|>", toy_image(11), "What is on screen?</s><|assistant|>"])
    prompt = inputs.pop("input_ids")[0].tolist()
    inputs.pop("attention_mask", None)
    handle = vision_tower(model).register_forward_pre_hook(lambda module, args: once())
    manager = cache.init_continuous_batching(config(NEW_TOKENS, eos_token_id=-1))
    manager.start()
    try:
        request_id = manager.add_request(prompt, images=inputs)
        output = finals(manager, [request_id], timeout=TIMEOUT_S)[request_id]
    finally:
        handle.remove()
    manager.stop()
    assert STEP_ERROR in str(once.outcome[0]) and output.error is None and len(output.generated_tokens) == NEW_TOKENS
    check_store(cache)
