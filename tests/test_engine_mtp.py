"""MTP heads as drafters (issue 44): a tiny Qwen3.5 checkpoint saved with ``mtp.*`` weights beside the model's (as
Qwen3.5 checkpoints ship them; transformers drops them at load), read with ``safetensors`` by :class:`MTPDrafter`.
Greedy tokens with it equal a cold ``generate()``; each round's drafts equal the head run over every position of the
target's final hidden states of a cold forward over the same tokens (the engine hands over the right positions, and
the head's own cache, fed a round's new pairs and cut back after the drafts, holds what one pass over them would);
what cannot run is refused with a sentence."""

import pytest
import torch
from engine_scenarios import alone, config, finals, ids
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from hf_hybridcache import HybridPrefixCache
from hf_hybridcache._compat.mtp import MTPHead, fuse_experts
from hf_hybridcache.engine import Drafter, EngineLimits, MTPDrafter, Speculation
from hf_hybridcache.toy import build_model

FAMILY = "qwen3_5_text"
K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("mtp") / "qwen3_5")


def save_checkpoint(folder, family: str = FAMILY, **config):
    """The seeded toy of ``family`` saved in ``folder`` with an MTP head of one layer in its model.safetensors, as
    Qwen3.5 and Qwen3-Next checkpoints ship one: the layer is a copy of the model's full-attention layer as
    ``save_pretrained`` wrote it (the checkpoint's own layout: routed experts one by one), ``fc`` and the norms
    random (norms too, so each one matters)."""
    model = build_model(family, seed=0, **config)
    model.config.mtp_num_hidden_layers = 1
    model.save_pretrained(folder)
    torch.manual_seed(44)
    head = {name: torch.randn(parameter.shape) * 0.2 for name, parameter in MTPHead(model.config).named_parameters()
            if not name.startswith("layers.")}
    tensors = load_file(folder / "model.safetensors")
    layer = f"model.layers.{model.config.layer_types.index('full_attention')}."
    head.update({f"layers.0.{name[len(layer):]}": value.clone() for name, value in tensors.items()
                 if name.startswith(layer)})
    tensors.update({f"mtp.{name}": value.contiguous() for name, value in head.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


class Recording(MTPDrafter):
    """Keeps each round's request tokens and drafts."""

    rounds: list

    def propose(self, requests, num_tokens):
        drafts = super().propose(requests, num_tokens)
        self.rounds.extend((list(r.tokens), d) for r, d in zip(requests, drafts))
        return drafts


def reference_drafts(model, head: MTPHead, tokens: list[int], num_tokens: int) -> list[int]:
    """The head in one pass over every pair ``(x_{j+1}, h_j)`` of a cold forward's final hidden states, then one
    token at a time from its own outputs."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state
        n, start = len(tokens) - 1, 0
        ids_, positions = torch.tensor([tokens[start + 1 :]]), torch.arange(start, n)[None]
        cache, h, drafts = DynamicCache(), hidden[:, start:], []
        for _ in range(num_tokens):
            out = head(model.get_input_embeddings()(ids_), h, positions, cache)[:, -1:]
            drafts.append(int(model.lm_head(out)[0, -1].argmax()))
            ids_, h, positions = torch.tensor([[drafts[-1]]]), out, positions[:, -1:] + 1
    return drafts


def test_transformers_drops_the_head_and_the_drafter_reads_it(checkpoint):
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert not any(name.startswith("mtp") for name, _ in loaded.named_parameters())
    drafter = MTPDrafter(checkpoint)
    assert "fc.weight" in drafter.weights and drafter.weights["fc.weight"].shape == (64, 128)


@pytest.mark.parametrize("bounds", ["roomy", "tight"])
def test_greedy_with_mtp_drafts_equals_cold_runs_and_drafts_follow_the_hidden_states(checkpoint, bounds):
    """``tight``: requests that cannot all hold their pages are preempted and recomputed from their stored prefix
    (the head's cache is cut back to where the recompute starts)."""
    model, cold = build_model(FAMILY, seed=0), build_model(FAMILY, seed=0)
    cache = HybridPrefixCache(model)
    drafter = Recording(checkpoint)
    drafter.rounds = []
    prompts = {"a": ids(20, seed=4460), "b": ids(5, seed=4461), "c": ids(33, seed=4462)}
    limits, new_tokens = None, 12
    if bounds == "tight":  # as tests/test_engine_speculative.py's tight bounds
        cache.max_cache_bytes = 3 * cache.spec.kv_block_bytes + cache.spec.checkpoint_bytes
        prompts.update({f"r{i}": ids(20 + 7 * i, seed=4465 + i) for i in range(4)})
        limits = EngineLimits(max_running_requests=4, max_batch_tokens=48, max_running_pages=6,
                              max_request_tokens=160)
        new_tokens = 40
    manager = cache.init_continuous_batching(config(max_new_tokens=new_tokens), limits=limits,
                                             speculation=Speculation(drafter, K))
    manager.start()
    try:
        names = dict(zip(manager.add_requests(list(prompts.values())), prompts))
        outputs = {names[rid]: out for rid, out in finals(manager, list(names)).items()}
    finally:
        manager.stop()
    for name, prompt in prompts.items():
        assert outputs[name].generated_tokens == alone(cold, prompt, new_tokens), name
    stats = manager.batch_processor.speculator.stats
    assert stats.verify_segments > 10 and stats.drafted_tokens > 0
    assert (manager.batch_processor.preempted > 0) == (bounds == "tight")
    assert len(drafter.rounds) >= stats.verify_segments  # a round whose request a tight step then left out
    for tokens, drafts in drafter.rounds:
        assert drafts == reference_drafts(cold, drafter.head.float(), tokens, len(drafts)), tokens


class Watching(Drafter):
    """Drafts each request's cold greedy continuation with one wrong token at a position that cycles 0 .. k (so
    every count of kept drafts occurs) and keeps the hidden states the engine hands over, by position."""

    wants_hidden_states = True

    def __init__(self, continuations: dict) -> None:
        self.continuations, self.rounds, self.seen = continuations, {}, {}

    def propose(self, requests, num_tokens):
        drafts = []
        for request, n in zip(requests, num_tokens):
            done = len(request.generated)
            draft = list(self.continuations[tuple(request.prompt)][done : done + n])
            at = self.rounds.get(request, 0) % (n + 1)
            self.rounds[request] = self.rounds.get(request, 0) + 1
            if at < len(draft):
                draft[at] = (draft[at] + 1) % 256
            drafts.append(draft)
        return drafts

    def observe(self, request, past, hidden):
        rows = self.seen.setdefault(tuple(request.prompt), {})
        rows.update({past + i: row.clone() for i, row in enumerate(hidden)})


def test_the_engine_hands_over_the_hidden_states_of_every_kept_position():
    """Prefill chunks (a long prompt in several), decodes and verify steps that keep 0 to k drafts: the hidden states
    handed over for positions ``0 .. L + n - 2`` equal a cold forward's over the request's tokens; the positions a
    prefix hit restored are not handed over (they never ran)."""
    model, cold = build_model(FAMILY, seed=0), build_model(FAMILY, seed=0)
    cache = HybridPrefixCache(model)
    prompts = [ids(70, seed=4463), ids(9, seed=4464)]
    continuations = {tuple(p): alone(cold, p, 14) for p in prompts}
    drafter = Watching(continuations)
    limits = EngineLimits(max_running_requests=4, max_batch_tokens=32, max_running_pages=64, max_request_tokens=128)
    generation = config(max_new_tokens=14, eos_token_id=-1)
    for round_ in range(2):  # the second round hits what the first stored
        manager = cache.init_continuous_batching(generation, limits=limits, speculation=Speculation(drafter, K))
        drafter.seen = {}
        manager.start()
        try:
            names = manager.add_requests(prompts)
            outputs = finals(manager, names)
        finally:
            manager.stop()
        for prompt, rid in zip(prompts, names):
            generated = outputs[rid].generated_tokens
            assert generated == continuations[tuple(prompt)]
            tokens = prompt + generated
            with torch.no_grad():
                hidden = cold.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
            seen = drafter.seen[tuple(prompt)]
            first = outputs[rid].hit_tokens
            assert (first > 0) == (round_ == 1 and len(prompt) > 16)  # a hit of whole blocks the first round stored
            assert sorted(seen) == list(range(first, len(tokens) - 1)), (round_, first)
            torch.testing.assert_close(torch.stack([seen[j] for j in sorted(seen)]), hidden[first:], atol=1e-4,
                                       rtol=1e-4)
        assert manager.batch_processor.speculator.stats.accepted_tokens > 0


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def test_the_head_reads_the_checkpoint_layout_as_transformers_reads_the_model(family, tmp_path):
    """The head's layer, read from ``mtp.layers.0.*`` (a copy of the full-attention layer's keys as saved: routed
    experts one by one), equals that layer as ``from_pretrained`` loads it into the model (experts fused), every
    parameter; greedy tokens with the head's drafts equal a cold ``generate()``."""
    from transformers import AutoModelForCausalLM

    folder = save_checkpoint(tmp_path / family, family)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    head = MTPHead(loaded.config)
    head.load_state_dict(fuse_experts(MTPDrafter(folder).weights), strict=False)
    layer = loaded.model.layers[loaded.config.layer_types.index("full_attention")].state_dict()
    mine = head.layers[0].state_dict()
    assert sorted(mine) == sorted(layer) and any("experts" in name for name in mine) == (family != "qwen3_5_text")
    for name, value in layer.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=name)
    cache = HybridPrefixCache(build_model(family, seed=0))
    manager = cache.init_continuous_batching(config(max_new_tokens=10),
                                             speculation=Speculation(MTPDrafter(folder), K))
    prompts = [ids(18, seed=4470), ids(7, seed=4471)]
    manager.start()
    try:
        outputs = finals(manager, manager.add_requests(prompts))
    finally:
        manager.stop()
    assert [o.generated_tokens for o in outputs.values()] == [alone(loaded, p, 10) for p in prompts]
    assert manager.batch_processor.speculator.stats.drafted_tokens > 0


def test_what_cannot_run_is_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="holds no mtp"):
        MTPDrafter(tmp_path)
    with pytest.raises(ValueError, match="is not one"):
        MTPDrafter(tmp_path / "nowhere")
    jamba = HybridPrefixCache(build_model("jamba", seed=0))
    manager = jamba.init_continuous_batching(config(max_new_tokens=4),
                                             speculation=Speculation(MTPDrafter(checkpoint), 2))
    with pytest.raises(ValueError, match="MTP heads are read for Qwen3.5"):
        manager.start()
    # the head of a wider model: a sentence, not load_state_dict's bare size mismatch
    wider = save_checkpoint(tmp_path / "wider", hidden_size=96)
    qwen = HybridPrefixCache(build_model(FAMILY, seed=0))
    manager = qwen.init_continuous_batching(config(max_new_tokens=4), speculation=Speculation(MTPDrafter(wider), 2))
    with pytest.raises(ValueError, match=r"are not this Qwen3_5ForCausalLM's head \(their shapes differ"):
        manager.start()
    manager = qwen.init_continuous_batching(config(max_new_tokens=4), speculation=Speculation(MTPDrafter(checkpoint), 2))
    manager.start()  # the cache and a right head still serve
    try:
        manager.add_request(ids(12, seed=990), request_id="after")
        assert finals(manager, ["after"])["after"].error is None
    finally:
        manager.stop()
