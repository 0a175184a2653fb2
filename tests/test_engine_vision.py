"""Images through the continuous-batching engine (issue 34), for every hybrid vision-language wrapper, in float32:
eight requests served together (one image asked three questions, another image under the same token ids, two images
in one prompt, a text prompt, a two-turn chat about one image) equal their solo cold generate() runs without the
cache (greedy tokens; every step's log-probability within 1e-4); the same ids with another image do not hit past the
block the image starts in (with power: token keys that ignore the image make it hit past it and answer about the
first image); the chat's second turn hits past its image and the vision tower does not run for it (counted by a hook
on the tower); Qwen3.5's 3D rotary positions reach the engine's forwards (with power); invalid image requests fail
alone with a sentence that says what is wrong, and the engine keeps serving."""

import pytest
import torch
from conftest import and_inkling2_loop
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache.core import check_store
from hf_hybridcache.engine import EngineLimits
from hf_hybridcache.multimodal import UNKEYED_INPUTS, Item
from hf_hybridcache.toy import VOCAB_SIZE
from hf_hybridcache.toy.vision import (
    IMAGE,
    TINY_WRAPPERS,
    build_vlm,
    qwen_processor,
    toy_image,
    vision_tower,
    vlm_inputs,
)

FAMILIES = and_inkling2_loop(sorted(TINY_WRAPPERS), "inkling2_loop")  # Inkling 2 Loop's: transformers >= 5.24
NEW_TOKENS = 8
SYSTEM = "<|system|>You describe screenshots.</s><|user|>"
_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    """One tiny wrapper per family for the module (a cache patches the instance; a cold generate() without the cache
    runs transformers' own code on it)."""
    if family not in _MODELS:
        _MODELS[family] = build_vlm(family, seed=5)
    return _MODELS[family]


def _prompts() -> dict[str, list]:
    return {
        "same_1": [SYSTEM, toy_image(11), "What is on screen?</s><|assistant|>"],
        "same_2": [SYSTEM, toy_image(11), "Which colors are there?</s><|assistant|>"],
        "same_3": [SYSTEM, toy_image(11), "Is there any text in it?</s><|assistant|>"],
        "other_image": [SYSTEM, toy_image(12), "What is on screen?</s><|assistant|>"],  # same_1's ids
        "two_images": [SYSTEM, toy_image(13), "and", toy_image(14), "What changed?</s><|assistant|>"],
        "text": [SYSTEM, "No screenshot today, sorry.</s><|assistant|>"],
        "chat_1": ["<|system|>You read charts.</s><|user|>", toy_image(15), "What does it show?</s><|assistant|>"],
    }


def _split(inputs: dict) -> tuple[list[int], dict]:
    """A prompt's ids and its images as add_request takes them (everything but input_ids and attention_mask)."""
    images = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    return inputs["input_ids"][0].tolist(), images


def _cold(model, inputs: dict, new_tokens: int) -> tuple[list[int], list[float]]:
    """The request alone: greedy generate() without the cache; its tokens and each one's log-probability."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]


class TowerCalls:
    """Counts the vision tower's forwards (a hook on the module, independent of the package)."""

    def __init__(self, model):
        self.calls = 0
        self._handle = vision_tower(model).register_forward_hook(self._count)

    def _count(self, *args):
        self.calls += 1

    def close(self):
        self._handle.remove()


def _manager(model):
    return model.init_continuous_batching(
        generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False),
        continuous_batching_config=ContinuousBatchingConfig(return_logprobs=True),
    )


def _final(manager, request_id: str):
    while True:
        output = manager.get_result(request_id=request_id, timeout=120)
        assert output is not None, f"no output for {request_id}"
        if output.is_finished():
            return output


def _serve(family: str) -> tuple[dict, dict, dict]:
    """The scenario through the engine: the seven prompts together, with invalid requests among them, then the chat's
    second turn once its first is answered. Returns the outputs, the prompts' inputs, and what the turn saw."""
    model = _model(family)
    cache = HybridPrefixCache(model)
    inputs = {name: vlm_inputs(family, parts) for name, parts in _prompts().items()}
    manager, tower = _manager(model), TowerCalls(model)
    manager.start()
    try:
        ids, images = zip(*(_split(inputs[name]) for name in inputs))
        names = dict(zip(manager.add_requests(list(ids), images=list(images)), inputs))  # taken in one go
        invalid = _invalid_requests(family, inputs["same_1"])
        for name, (prompt, prompt_images, _) in invalid.items():
            manager.add_request(prompt, request_id=name, images=prompt_images)
        outputs = {name: _final(manager, name) for name in invalid}
        outputs["chat_1"] = _final(manager, next(rid for rid, name in names.items() if name == "chat_1"))
        reply = [t if t < VOCAB_SIZE else 6 for t in outputs["chat_1"].generated_tokens]  # placeholders as text
        turn_2 = [reply, "</s><|user|>And the trend?</s><|assistant|>"]
        inputs["chat_2"] = vlm_inputs(family, _prompts()["chat_1"] + turn_2)
        calls, skipped = tower.calls, cache.stats.images_skipped
        prompt, prompt_images = _split(inputs["chat_2"])
        manager.add_request(prompt, request_id="chat_2", images=prompt_images)
        outputs["chat_2"] = _final(manager, "chat_2")
        turn = {"tower_calls": tower.calls - calls, "skipped": cache.stats.images_skipped - skipped}
        outputs.update({name: _final(manager, rid) for rid, name in names.items() if name not in outputs})
    finally:
        manager.stop()
        tower.close()
    check_store(cache)
    return outputs, inputs, {"turn": turn, "invalid": invalid, "stats": cache.stats}


def _invalid_requests(family: str, inputs: dict) -> dict:
    """``{request id: (ids, images, what its error says)}``: placeholders and pixels that disagree, pixels without
    their grid, pixel rows the tower cannot take (its error, at admission or in a forward of its own), placeholders
    without images, and an input the cache does not key (audio where the wrapper takes it)."""
    ids, images = _split(inputs)
    cut = ids[: ids.index(IMAGE)] + ids[ids.index(IMAGE) + 1 :]  # one placeholder fewer than the pixels describe
    unkeyed = UNKEYED_INPUTS.get(family, ("input_features",))[0]
    grid = next((name for name in images if name not in ("pixel_values", "mm_token_type_ids")), None)
    narrow = {**images, "pixel_values": images["pixel_values"][..., :-1]}  # rows the tower cannot take
    return {
        "bad_count": (cut, images, "disagree"),
        "no_grid": (ids, {"pixel_values": images["pixel_values"]}, f"needs {grid}") if grid else (ids, narrow, ""),
        "bad_pixels": (ids, narrow, ""),
        "no_images": (ids, None, "no images were passed"),
        "audio": (ids, {**images, unkeyed: torch.zeros(1, 4)}, "does not serve" if family in UNKEYED_INPUTS
                  else "Unknown image inputs"),
    }


def _check_equal_cold(family: str, outputs: dict, inputs: dict) -> None:
    model = _model(family)
    for name, prompt_inputs in inputs.items():
        output = outputs[name]
        assert output.error is None, f"{name}: {output.error}"
        tokens, logprobs = _cold(model, prompt_inputs, NEW_TOKENS)
        assert output.generated_tokens == tokens, name
        torch.testing.assert_close(torch.tensor(output.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4, msg=name)


def _image_block_start(inputs: dict, block_size: int = 16) -> int:
    """The first token of the block an image's first placeholder is in: no hit of another image may pass it."""
    return int((inputs["input_ids"][0] == IMAGE).nonzero()[0]) // block_size * block_size


def _check_other_image(outputs: dict, inputs: dict) -> None:
    """The same ids with another image share only the blocks before the image (their replies differ)."""
    assert inputs["other_image"]["input_ids"].tolist() == inputs["same_1"]["input_ids"].tolist()
    assert outputs["other_image"].hit_tokens <= _image_block_start(inputs["other_image"])
    assert outputs["same_1"].hit_tokens <= _image_block_start(inputs["same_1"])


@pytest.mark.parametrize("family", FAMILIES)
def test_eight_requests_with_images_equal_their_cold_runs_and_a_second_turn_skips_the_tower(family):
    outputs, inputs, seen = _serve(family)
    _check_equal_cold(family, outputs, inputs)
    _check_other_image(outputs, inputs)
    image_end = int((inputs["chat_2"]["input_ids"][0] == IMAGE).nonzero()[-1]) + 1
    assert outputs["chat_2"].hit_tokens >= image_end  # the second turn hits past its image ...
    assert seen["turn"] == {"tower_calls": 0, "skipped": 1}  # ... and the tower did not run for it
    assert max(outputs[n].hit_tokens for n in ("same_2", "same_3")) > _image_block_start(inputs["same_1"])
    for name, (_, _, says) in seen["invalid"].items():
        assert outputs[name].error is not None and says in outputs[name].error, (name, outputs[name].error)
        assert outputs[name].generated_tokens == []
    stats = seen["stats"]
    assert stats.vision_encoder_calls >= 1 and stats.images_encoded >= 6


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2_vl", "inkling_mm_model"])
def test_power_keys_that_ignore_the_image_hit_past_it(family, monkeypatch):
    """With placeholder keys that ignore the image's content (its digest), the other image's request shares the first
    image's blocks: it hits past its image's first block and the checks above fail."""
    monkeypatch.setattr(Item, "keys", lambda self: [-1 - j for j in range(len(self.positions))])
    model = _model(family)
    cache = HybridPrefixCache(model)  # noqa: F841 - the model's engine serves this cache while it lives
    inputs = {name: vlm_inputs(family, _prompts()[name]) for name in ("same_1", "other_image")}
    manager = _manager(model)
    manager.start()
    try:
        ids, images = zip(*(_split(prompt_inputs) for prompt_inputs in inputs.values()))
        request_ids = manager.add_requests(list(ids), images=list(images))
        outputs = {name: _final(manager, rid) for name, rid in zip(inputs, request_ids)}
    finally:
        manager.stop()
    assert outputs["other_image"].hit_tokens > _image_block_start(inputs["other_image"])
    with pytest.raises(AssertionError):
        _check_other_image(outputs, inputs)
    with pytest.raises(AssertionError):
        _check_equal_cold(family, outputs, inputs)


def test_qwen_processor_outputs_are_taken_as_they_are_and_3d_positions_reach_the_forward(monkeypatch):
    """Qwen3.5 with its processor's outputs (pixel_values, image_grid_thw, mm_token_type_ids) equals a cold run; with
    token positions in place of the 3D ones (power) the log-probabilities move."""
    model = _model("qwen3_5")
    processor = qwen_processor()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the chart."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = dict(processor(text=[text], images=[toy_image(31, 64, 48)], return_tensors="pt"))
    assert "mm_token_type_ids" in inputs
    tokens, logprobs = _cold(model, inputs, NEW_TOKENS)
    cache = HybridPrefixCache(model)

    def served():
        manager = _manager(model)
        manager.start()
        try:
            prompt, images = _split(inputs)
            return _final(manager, manager.add_request(prompt, images=images))
        finally:
            manager.stop()

    output = served()
    assert output.error is None and output.generated_tokens == tokens
    torch.testing.assert_close(torch.tensor(output.logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4)
    monkeypatch.setattr("hf_hybridcache.engine.images.rope_positions", lambda *args: None)
    cache.clear()  # a cold start, so the power run computes its prompt
    moved = served()
    assert abs(moved.logprobs[0] - logprobs[0]) > 1e-3


@pytest.mark.parametrize("family", ["qwen3_5", "inkling_mm_model"])
def test_a_sampled_placeholder_id_runs_beside_images_without_a_failed_forward(family):
    """A request that feeds a placeholder id it sampled (every id but the image's is suppressed) decodes while another
    request's prompt with an image is prefilled: it runs in a forward without images, so no forward raises (power:
    in one forward with the image rows the wrapper counts one placeholder too many and raises; the engine then
    recovers by running them apart, and the preemption shows it) and both equal their cold runs."""
    model = _model(family)
    cache = HybridPrefixCache(model)  # noqa: F841 - the model's engine serves this cache while it lives
    suppress = [t for t in range(model.get_input_embeddings().num_embeddings) if t != IMAGE]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, suppress_tokens=suppress)
    text, image = (vlm_inputs(family, parts) for parts in (_prompts()["text"], _prompts()["same_1"]))
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        text_id = manager.add_request(_split(text)[0], max_new_tokens=4 * NEW_TOKENS, streaming=True)
        first = manager.get_result(request_id=text_id, timeout=120)
        assert first is not None and first.generated_tokens == [IMAGE]
        prompt, images = _split(image)
        image_output = _final(manager, manager.add_request(prompt, images=images))
        text_output = _final(manager, text_id)
    finally:
        manager.stop()
    assert manager.batch_processor.preempted == 0
    for output, inputs, new_tokens in ((image_output, image, NEW_TOKENS), (text_output, text, 4 * NEW_TOKENS)):
        assert output.error is None
        with torch.no_grad():
            cold = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, suppress_tokens=suppress)
        assert output.generated_tokens == cold[0, inputs["input_ids"].shape[1]:].tolist()


def test_generate_batch_takes_one_images_entry_per_prompt():
    """``model.generate_batch(inputs, images=[...])`` carries each prompt's images to its request (None: a text
    prompt); a list of another length is refused."""
    model = _model("lfm2_vl")
    cache = HybridPrefixCache(model)  # noqa: F841 - the model's engine serves this cache while it lives
    inputs = [vlm_inputs("lfm2_vl", _prompts()[name]) for name in ("same_1", "other_image", "text")]
    ids, images = zip(*(_split(prompt_inputs) for prompt_inputs in inputs))
    images = [entry or None for entry in images]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    outputs = list(model.generate_batch(list(ids), generation_config=config, images=images).values())
    assert [output.generated_tokens for output in outputs] == [_cold(model, i, NEW_TOKENS)[0] for i in inputs]
    assert outputs[1].hit_tokens <= _image_block_start(inputs[1])
    with pytest.raises(ValueError, match="one entry"):
        model.generate_batch(list(ids), generation_config=config, images=images[:2])


def test_an_lfm2_vl_image_hits_in_the_engine_when_a_larger_image_joins_its_prompt():
    """The engine keys a request's images as generate() does: an LFM2-VL tile's padding to the longest tile of its
    prompt is not part of its key, so a prompt that adds a larger image after it hits past it (fails without the
    unpadded digest: its hit stops before the image)."""
    model = _model("lfm2_vl")
    cache = HybridPrefixCache(model)  # noqa: F841 - the model's engine serves this cache while it lives
    first = ["<|system|>You describe screenshots.</s><|user|>", toy_image(61), "What is on it?</s><|assistant|>"]
    inputs = [vlm_inputs("lfm2_vl", first),
              vlm_inputs("lfm2_vl", first + ["Menus.</s><|user|>", toy_image(62, 96, 64), "And now?</s>"])]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False)
    outputs = [next(iter(model.generate_batch([ids], generation_config=config, images=[images]).values()))
               for ids, images in map(_split, inputs)]
    assert [output.generated_tokens for output in outputs] == [_cold(model, i, NEW_TOKENS)[0] for i in inputs]
    assert outputs[1].hit_tokens > int((inputs[0]["input_ids"][0] == IMAGE).nonzero()[-1])


@pytest.mark.parametrize("family", ["qwen3_5", "inkling_mm_model"])
def test_chunked_prefill_feeds_each_chunk_its_own_rows_and_encodes_once(family):
    """Prompts cut into 16-token chunks (``max_batch_tokens=20``) across their images equal their cold runs; each
    request's image is encoded once, not per chunk (power: handing a chunk every row of its image, or encoding per
    chunk, fails this)."""
    model = _model(family)
    cache = HybridPrefixCache(model)
    inputs = [vlm_inputs(family, _prompts()[name]) for name in ("same_1", "other_image", "text")]
    manager = cache.init_continuous_batching(GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False),
                                             ContinuousBatchingConfig(return_logprobs=True),
                                             limits=EngineLimits(max_batch_tokens=20))
    tower = TowerCalls(model)
    manager.start()
    try:
        ids, images = zip(*(_split(prompt_inputs) for prompt_inputs in inputs))
        request_ids = manager.add_requests(list(ids), images=[entry or None for entry in images])
        outputs = dict(zip(("same_1", "other_image", "text"), (_final(manager, rid) for rid in request_ids)))
    finally:
        manager.stop()
        tower.close()
    _check_equal_cold(family, outputs, dict(zip(outputs, inputs)))
    assert manager.batch_processor.steps > len(ids[0]) // 20  # the prompts ran in chunks
    assert tower.calls == cache.stats.vision_encoder_calls == 2 and cache.stats.images_encoded == 2
