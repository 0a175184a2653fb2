"""Images in the prompt of every hybrid vision-language wrapper (issue 34), through generate(), in float32: a chat
about one image and a chat with a new image every turn equal cold runs (greedy tokens, first-step logits within
1e-4); the same token ids with another image never hit past the image's first block (with power: keys that ignore
the image hit past it and change the reply); a hit that holds the image does not call the vision tower, and its
TTFT is below a cold run's by at least the tower's own time; a hit that ends inside an image encodes it and hands
the model the rows of the tail.
"""

import time

import pytest
import torch
from conftest import and_inkling2_loop

from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.multimodal import ImagePrompt
from hf_hybridcache.toy import VOCAB_SIZE, byte_tokenizer
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
NEW_TOKENS = 6
_MODELS: dict[str, torch.nn.Module] = {}


def _model(family: str) -> torch.nn.Module:
    """One tiny wrapper per family for the module (the cache patches the instance; cold runs use the same one, whose
    generate() without the cache runs transformers' own code)."""
    if family not in _MODELS:
        _MODELS[family] = build_vlm(family, seed=3)
    return _MODELS[family]


class TowerCalls:
    """Counts the vision tower's forwards and their time (a hook on the module, independent of the package)."""

    def __init__(self, model):
        self.calls, self.seconds, self._started = 0, 0.0, 0.0
        tower = vision_tower(model)
        self._handles = [tower.register_forward_pre_hook(self._pre), tower.register_forward_hook(self._post)]

    def _pre(self, *args):
        self._started = time.perf_counter()

    def _post(self, *args):
        self.calls += 1
        self.seconds += time.perf_counter() - self._started

    def close(self):
        for handle in self._handles:
            handle.remove()


def _ids(text: str) -> list[int]:
    return byte_tokenizer()(text, add_special_tokens=False)["input_ids"]


def _generate(model, inputs: dict, cache=None, new_tokens: int = NEW_TOKENS):
    kwargs = {CACHE_KWARG: cache} if cache is not None else {}
    return model.generate(**inputs, **kwargs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)


def _check_equal_cold(model, inputs: dict, cache):
    """A cached run of ``inputs`` equals a cold one: greedy tokens, first-step logits within 1e-4; returns the reply
    token ids."""
    cold = _generate(model, inputs)
    out = _generate(model, inputs, cache)
    assert torch.equal(out.sequences, cold.sequences)
    torch.testing.assert_close(out.logits[0], cold.logits[0], rtol=0, atol=1e-4)
    # The random model may emit a placeholder id; the next prompt keeps the reply as text (ids of real tokens).
    return [t if t < VOCAB_SIZE else 6 for t in out.sequences[0, inputs["input_ids"].shape[1]:].tolist()]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_four_turn_chat_about_one_image_equals_cold_runs_and_never_encodes_it_again(family):
    model = _model(family)
    cache = HybridPrefixCache(model)
    tower = TowerCalls(model)
    try:
        parts = ["<|system|>You describe screenshots.</s><|user|>", toy_image(11), "What is on screen?</s><|assistant|>"]
        for turn in range(4):
            inputs = vlm_inputs(family, parts)
            calls = tower.calls
            reply = _check_equal_cold(model, inputs, cache)
            images = cache.last_images
            if turn == 0:
                assert (images.encoded, images.skipped) == (1, 0)
            else:
                # The hit holds the whole image: the cached run did not call the tower (the cold one did, once).
                first_after_image = int((inputs["input_ids"][0] == IMAGE).nonzero()[-1]) + 1
                assert cache.last_hit_tokens[0] >= first_after_image
                assert (images.encoded, images.skipped, images.encoder_calls) == (0, 1, 0)
                assert tower.calls == calls + 1
            parts = parts + [reply, f"</s><|user|>And question {turn + 2}?</s><|assistant|>"]
    finally:
        tower.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chat_with_a_new_image_every_turn_equals_cold_runs_and_encodes_only_the_new_one(family):
    model = _model(family)
    cache = HybridPrefixCache(model)
    parts = ["<|system|>You compare screenshots.</s>"]
    for turn in range(4):
        parts = parts + ["<|user|>", toy_image(20 + turn), f"Screen {turn + 1}: what changed?</s><|assistant|>"]
        inputs = vlm_inputs(family, parts)
        reply = _check_equal_cold(model, inputs, cache)
        images = cache.last_images
        assert (images.items, images.encoded, images.skipped) == (turn + 1, 1, turn)
        if turn:
            assert cache.last_hit_tokens[0] > 0
        parts = parts + [reply, "</s>"]


def _first_image_block(inputs: dict, block_size: int) -> int:
    """The start of the block that holds the prompt's first image placeholder: no hit may reach past it."""
    first = int((inputs["input_ids"][0] == IMAGE).nonzero()[0])
    return first // block_size * block_size


def _same_ids_other_image(model, family: str):
    """Prompt A with one image, then prompt B: the same token ids and another image. Returns the cache's hit for B
    and whether B's cached run equals its cold run."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    text = ["<|user|>Here is the login page of our app, please look closely: ", None, "Which button is red?</s>"]
    a = vlm_inputs(family, [part if part is not None else toy_image(31) for part in text])
    b = vlm_inputs(family, [part if part is not None else toy_image(32) for part in text])
    assert torch.equal(a["input_ids"], b["input_ids"])
    _generate(model, a, cache)
    out, cold = _generate(model, b, cache), _generate(model, b)
    same = torch.equal(out.sequences, cold.sequences) and torch.allclose(out.logits[0], cold.logits[0], atol=1e-4)
    return cache.last_hit_tokens[0], _first_image_block(b, cache.block_size), same


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_ids_with_another_image_never_hit_past_the_images_first_block(family):
    hit, bound, same = _same_ids_other_image(_model(family), family)
    assert 0 < hit <= bound  # the text before the image is shared, nothing after its first block
    assert same


@pytest.mark.parametrize("family", FAMILIES)
def test_power_keys_that_ignore_the_image_hit_past_it_and_change_the_reply(family, monkeypatch):
    """The test above has power: with token keys that ignore the images (the placeholder ids themselves, and no
    guard against storing them), B hits the blocks of A's image and its first-step logits leave a cold run's."""
    monkeypatch.setattr(ImagePrompt, "keys", lambda self, input_ids: input_ids)
    monkeypatch.setattr(HybridPrefixCache, "placeholder_ids", frozenset())
    hit, bound, same = _same_ids_other_image(_model(family), family)
    assert hit > bound
    assert not same


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_hits_when_a_later_larger_image_joins_its_prompt(family):
    """An image's key does not depend on the other images of its prompt: a processor pads LFM2-VL's tiles to the
    longest one of the call, and a digest over the padded rows made the same image miss once a larger image followed
    it (LFM2-VL: hit 0 instead of past the image's 52nd position; fails without the unpadded digest)."""
    model = _model(family)
    cache = HybridPrefixCache(model)
    first = ["<|system|>You describe screenshots.</s><|user|>", toy_image(61), "What is on it?</s><|assistant|>"]
    alone = vlm_inputs(family, first)
    _check_equal_cold(model, alone, cache)
    second = vlm_inputs(family, first + ["Menus.</s><|user|>", toy_image(62, 96, 64), "And now?</s><|assistant|>"])
    _check_equal_cold(model, second, cache)
    assert cache.last_hit_tokens[0] > int((alone["input_ids"][0] == IMAGE).nonzero()[-1])
    assert (cache.last_images.encoded, cache.last_images.skipped) == (1, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_that_ends_inside_an_image_encodes_it_and_equals_a_cold_run(family):
    """Prompt A's last checkpoint below its end lies inside its image; prompt B shares A up to the image's end and
    then differs: B restores into the image, encodes it and hands the model only its rows after the hit."""
    model = _model(family)
    cache = HybridPrefixCache(model, retention_interval="dense")
    image = toy_image(41, 48, 48)
    probe = vlm_inputs(family, ["<|user|>Look:", image])
    first, end = [int(i) for i in (probe["input_ids"][0] == IMAGE).nonzero()[[0, -1], 0]]
    inside = (end // cache.block_size) * cache.block_size
    assert first < inside <= end, "the image must cross a block boundary"
    _generate(model, vlm_inputs(family, ["<|user|>Look:", image, "Is it a chart?</s>"]), cache)
    b = vlm_inputs(family, ["<|user|>Look:", image, "Where is the menu?</s>"])
    _check_equal_cold(model, b, cache)
    assert first < cache.last_hit_tokens[0] <= end + 1
    assert (cache.last_images.encoded, cache.last_images.skipped) == (1, 0)


def _ttft(model, inputs: dict, cache=None) -> float:
    started = time.perf_counter()
    _generate(model, inputs, cache, new_tokens=1)
    return time.perf_counter() - started


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hit_that_holds_the_image_is_faster_than_cold_by_the_towers_time(family):
    """TTFT of a second question about the same large image: below the cold run's minus the tower's own time in it
    (best of three each, so a busy CPU's hiccups do not decide)."""
    model = _model(family)
    cache = HybridPrefixCache(model)
    image = toy_image(51, 128, 96)
    system = "<|system|>" + "You read dashboards for the operations team and answer in one line. " * 8 + "</s>"
    first = vlm_inputs(family, [system, "<|user|>", image, "What does this dashboard show?</s><|assistant|>"])
    _generate(model, first, cache)
    second = vlm_inputs(family, [system, "<|user|>", image, "What does this dashboard show?</s><|assistant|>A chart."
                                 "</s><|user|>Which value is highest?</s><|assistant|>"])
    tower = TowerCalls(model)
    try:
        cold, tower_seconds = [], []
        for _ in range(3):
            before = tower.seconds
            cold.append(_ttft(model, second))
            tower_seconds.append(tower.seconds - before)
        calls = tower.calls
        hits = [_ttft(model, second, cache) for _ in range(3)]
        assert tower.calls == calls  # no hit called the tower
    finally:
        tower.close()
    assert cache.last_hit_tokens[0] > int((second["input_ids"][0] == IMAGE).nonzero()[-1])
    assert min(hits) < min(cold) - min(tower_seconds), (hits, cold, tower_seconds)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_image_text_to_text_pipeline_with_the_cache_equals_it_without(family):
    """pipeline("image-text-to-text") with a processor made in code: chat messages with an image part; the second
    question about the image restores it and skips the tower, and every reply equals the pipeline's without the
    cache."""
    from transformers import pipeline

    model = _model(family)
    model.generation_config.pad_token_id = 0
    pipe = pipeline("image-text-to-text", model=model, processor=qwen_processor())
    cache = HybridPrefixCache(model)
    image = toy_image(61)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Title?"}]}]
    for turn in range(2):
        kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
        cold = pipe(text=messages, generate_kwargs=kwargs)[0]["generated_text"][-1]
        out = pipe(text=messages, generate_kwargs={**kwargs, CACHE_KWARG: cache})[0]["generated_text"][-1]
        assert out == cold
        if turn:
            assert cache.last_hit_tokens[0] > 0 and cache.last_images.skipped == 1
        messages = messages + [out, {"role": "user", "content": [{"type": "text", "text": "And the date?"}]}]


def test_the_image_chat_benchmark_runs_on_a_tiny_wrapper(capsys):
    from benchmarks import image_chat

    results = image_chat.main(["--families", "lfm2_vl", "--turns", "2", "--repeats", "1", "--new-tokens", "4",
                               "--image", "48x32", "--size", "tiny"])
    (_, _, screenshots), (_, _, one_image) = results
    assert [r["encoded"] for r in screenshots] == [1, 1] and [r["encoded"] for r in one_image] == [1, 0]
    assert one_image[1]["hit"] > 0 and one_image[1]["hit_tower"] == 0.0
    out = capsys.readouterr().out
    assert "hit tower ms" in out and "margin ms" in out and "of 2 turns after the first" in out


def _video_prompt(family: str, seed: int, question: str) -> dict:
    """A prompt with a 4-frame video in Qwen2-VL's layout (two temporal patches of 8 x 12 patches; each frame's
    placeholders between the delimiters after a timestamp, as Qwen3.5's processor writes them)."""
    from hf_hybridcache.toy.vision import END, START, VIDEO

    generator = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[2, 8, 12]])
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 4 * 4, generator=generator)
    ids = _ids("<|user|>Watch this clip: ")
    for frame in range(2):
        ids += _ids(f"<{frame}.0 seconds>") + [START] + [VIDEO] * (8 * 12 // 4) + [END]
    input_ids = torch.tensor([ids + _ids(question)])
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values_videos=pixels,
                  video_grid_thw=grid)
    if family.startswith("qwen3_5"):
        inputs["mm_token_type_ids"] = (input_ids == VIDEO).int() * 2
    return inputs


@pytest.mark.parametrize("family", ["qwen3_5", "lfm3_vl"])
def test_videos_are_keyed_by_their_frames_and_skipped_on_a_hit(family):
    """A video's placeholders (one run per frame) are keyed by its content like an image's: a second question about
    it skips it, and another video with the same ids hits no further than the block of its first placeholder."""
    from hf_hybridcache.toy.vision import VIDEO

    model = _model(family)
    cache = HybridPrefixCache(model, retention_interval="dense")
    _check_equal_cold(model, _video_prompt(family, 1, "What happens?"), cache)
    _check_equal_cold(model, _video_prompt(family, 1, "What happens next?"), cache)
    assert (cache.last_images.encoded, cache.last_images.skipped) == (0, 1)
    other = _video_prompt(family, 2, "What happens?")
    _check_equal_cold(model, other, cache)
    first = int((other["input_ids"][0] == VIDEO).nonzero()[0])
    assert 0 < cache.last_hit_tokens[0] <= first // cache.block_size * cache.block_size
    assert cache.last_images.encoded == 1


def _direct_forward_then_text_only(model, family: str):
    """A direct forward of a prompt with its image over the cache, then generate() of the same ids without the
    image (the placeholder ids embedded as tokens, as a cold run does): whether that run equals its cold run."""
    cache = HybridPrefixCache(model, retention_interval="dense")
    inputs = vlm_inputs(family, ["<|user|>Here is the login page of our app, please look closely: ", toy_image(71),
                                 "Which button is red?</s>"])
    with torch.no_grad():
        model(**inputs, **{CACHE_KWARG: cache}, use_cache=True)
    text_only = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    out, cold = _generate(model, text_only, cache), _generate(model, text_only)
    return torch.allclose(out.logits[0], cold.logits[0], atol=1e-4)


def test_a_forward_that_feeds_an_image_outside_generate_is_not_stored_under_its_ids(monkeypatch):
    """A direct forward (a decoding loop of its own) feeds placeholder ids whose features the cache has no key for:
    nothing of it is stored, so a later run of the same ids finds nothing of the image's blocks. With power: without
    the guard, the text-only run restores the image's states and leaves its cold run."""
    model = _model("lfm2_vl")
    assert _direct_forward_then_text_only(model, "lfm2_vl")
    monkeypatch.setattr(HybridPrefixCache, "placeholder_ids", frozenset())
    assert not _direct_forward_then_text_only(model, "lfm2_vl")


def _after_a_longer_request(model, family: str) -> float:
    """A long prompt with a wide image, then a short one with a tall image (its placeholders all before the first
    prompt's length): the short one's first-step logits against its cold run."""
    cache = HybridPrefixCache(model)
    long = vlm_inputs(family, ["<|user|>A long first prompt about a wide screenshot that goes on and on: ",
                               toy_image(81, 64, 32), "Describe every part of it in detail please.</s><|assistant|>"])
    short = vlm_inputs(family, ["<|user|>", toy_image(82, 32, 64), "Tall one?</s><|assistant|>"])
    _generate(model, long, cache, new_tokens=30)
    out, cold = _generate(model, short, cache), _generate(model, short)
    return float((out.logits[0] - cold.logits[0]).abs().max())


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_positions_come_from_the_whole_prompt_after_a_longer_request(family, monkeypatch):
    """generate() computes Qwen3.5's 3D positions and rope_deltas before the request restores anything; the cache
    reports 0 cached tokens until then. With power: reporting the previous request's length instead makes
    generate() reuse that request's rope_deltas (no new vision tokens after that length), and the logits move."""
    from transformers.cache_utils import Cache

    model = _model(family)
    assert _after_a_longer_request(model, family) < 1e-4
    monkeypatch.setattr(HybridPrefixCache, "get_seq_length", lambda self, layer_idx=0: Cache.get_seq_length(self))
    assert _after_a_longer_request(model, family) > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_realistic_size_keeps_the_prompt(family):
    from hf_hybridcache.toy.vision import build_vlm, vision_tower, vlm_inputs

    tiny, realistic = build_vlm(family), build_vlm(family, size="realistic")
    size = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    grown = 1 if family == "inkling_mm_model" else 10  # its tower's shape is fixed by its patch layout
    assert size(vision_tower(realistic)) >= grown * size(vision_tower(tiny))
    assert size(realistic) - size(vision_tower(realistic)) > 2 * (size(tiny) - size(vision_tower(tiny)))
    inputs = vlm_inputs(family, ["<|user|>", toy_image(3, 48, 32), "What is it?"])
    with torch.no_grad():
        assert realistic(**inputs).logits.shape == tiny(**inputs).logits.shape
    with pytest.raises(ValueError, match="realistic"):
        build_vlm(family, size="huge")
