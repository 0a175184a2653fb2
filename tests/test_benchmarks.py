"""The hit-rate benchmark's parts: seeded workloads, the JSONL loader, and the trace simulator, whose hits must be the
ones the cache gives when the model really runs (it replays the cache's own bookkeeping with meta tensors)."""

import json
import os

import pytest
import torch

from benchmarks.simulate import TraceRequest, meta_model, replay, tokenize_workload
from benchmarks.workloads import WORKLOADS, agent_tree, load_jsonl_chats, multi_turn_chats
from hf_hybridcache import CACHE_KWARG, HybridPrefixCache
from hf_hybridcache.toy import build_model, byte_tokenizer


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_are_seeded(name):
    small = dict(num_requests=6) if name in ("a_system_prompt", "c_few_shot") else {}
    if name == "b_multi_turn":
        small = dict(num_chats=3, turns=2)
    if name == "d_agent_tree":
        small = dict(num_tasks=2, max_steps=2)
    first, again, other = (WORKLOADS[name](seed=s, **small) for s in (0, 0, 1))
    assert first.to_list() == again.to_list()
    assert first.to_list() != other.to_list()
    assert {"request_id", "session", "messages", "reply"} <= set(first.column_names)


def test_multi_turn_turn_k_extends_turn_k_minus_1():
    chats = multi_turn_chats(num_chats=3, turns=3)
    last = {}
    for row in chats:
        if row["session"] in last:
            previous = last[row["session"]]
            assert row["messages"][: len(previous["messages"]) + 1] == previous["messages"] + [
                {"role": "assistant", "content": previous["reply"]}
            ]
        last[row["session"]] = row


def test_jsonl_chats_give_one_request_per_assistant_message(tmp_path):
    path = tmp_path / "chats.jsonl"
    chats = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "fine"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"},
         {"role": "assistant", "content": "4"}],
    ]
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    requests = load_jsonl_chats(str(path))
    assert requests["reply"] == ["hello", "fine", "4"]
    assert requests["session"] == ["chat-0", "chat-0", "chat-1"]
    assert requests["messages"][1] == chats[0][:3]


def test_jsonl_without_replies_is_refused_with_advice(tmp_path):
    """A file without an assistant reply used to give an empty dataset that crashed the benchmarks later with
    "Column 'session' doesn't exist"."""
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "no reply"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant message"):
        load_jsonl_chats(str(path))


@pytest.mark.parametrize("eviction,replay_replies", [("flop_aware", False), ("lru", False), ("flop_aware", True)])
def test_simulated_hits_equal_real_hits(eviction, replay_replies):
    """Real greedy runs of an agent-tree trace under a budget that forces evictions, then the same trace (prompts and
    the tokens generate() produced) through the simulator on a meta copy of the model: same hits, same stats (with
    replies replayed at the end of generate(), as bf16 models do by default, too)."""
    model = build_model("jamba", seed=0)
    tokenizer = byte_tokenizer()
    requests = tokenize_workload(agent_tree(num_tasks=3, max_steps=2, trunk_chars=1700, seed=3), tokenizer)[:6]
    probe = HybridPrefixCache(model)
    budget = 200 * probe.spec.kv_block_bytes + 3 * probe.spec.checkpoint_bytes
    options = dict(max_cache_bytes=budget, eviction=eviction, seed=b"simulation", replay_replies=replay_replies)
    cache = HybridPrefixCache(model, **options)
    real_hits, trace = [], []
    for request in requests:
        ids = torch.tensor([request.prompt_ids])
        out = model.generate(ids, **{CACHE_KWARG: cache}, max_new_tokens=5, do_sample=False)
        real_hits.append(cache.last_hit_tokens[0])
        trace.append(TraceRequest(request.prompt_ids, out[0, ids.shape[1]:].tolist()))
    assert cache.stats.evicted_checkpoints > 0 and max(real_hits) > 0, "the trace must hit and evict"
    simulated = replay(HybridPrefixCache(meta_model(model.config, model.dtype), **options), trace)
    assert simulated.hits == real_hits
    real, sim = cache.stats, simulated.stats
    assert (real.replayed_reply_tokens > 0) == replay_replies
    for name in ("kv_blocks", "checkpoints", "stored_bytes", "evicted_kv_blocks", "evicted_checkpoints",
                 "divergence_checkpoints", "hit_tokens", "replayed_reply_tokens"):
        assert getattr(sim, name) == getattr(real, name), name


def test_eviction_scale_runs_on_a_tiny_store(capsys, monkeypatch):
    from benchmarks import eviction_scale

    argv = ["eviction_scale", "--entries", "300", "--small-entries", "60", "--requests", "5"]
    monkeypatch.setattr("sys.argv", argv)
    eviction_scale.main()
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| policy |") and [row.split(" | ")[0] for row in table[2:]] == ["| lru", "| flop_aware"]


def test_ttft_runs_on_a_tiny_real_shape(capsys):
    """``ttft.py --family``: the table's rows, the bytes of a KV block and a checkpoint, and an exact hit."""
    from benchmarks import ttft

    ttft.main(["--family", "qwen3_5_text", "--shape", "tiny", "--prefixes", "64", "--suffix-tokens", "16",
               "--repeats", "1", "--hit-repeats", "1", "--retention", "64"])
    out = capsys.readouterr().out
    assert "qwen3_5_text 'tiny'" in out and "KV block 4 KiB" in out and "checkpoint 0.02 MiB" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("64 |") and "-" in line.split("|")[1])
    hit_tokens, max_logit_diff = row.split("|")[-1].split()
    assert int(hit_tokens) == 64 and float(max_logit_diff) < 1e-4


def test_weights_identity_runs_on_tiny_real_shapes(capsys):
    """``weights_identity.py``: one row per shape and dtype, the full identity and the per-request check timed (it
    asserts that the check with unchanged weights changes nothing)."""
    from benchmarks import weights_identity

    weights_identity.main(["--shapes", "qwen3_5_text:tiny", "--dtypes", "float32", "bfloat16", "--repeats", "1",
                           "--check-calls", "2"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen")]
    assert [(row[0].strip(), row[1].strip()) for row in rows] == [("qwen3_5_text:tiny", "float32"),
                                                                    ("qwen3_5_text:tiny", "bfloat16")]
    assert all(float(row[7]) > 0 and row[9].strip().endswith("%") for row in rows)


def test_model_shapes_build_with_their_layer_pattern():
    from benchmarks.model_shapes import SHAPES, shape_config

    for family, shapes in SHAPES.items():
        for name, shape in shapes.items():
            config, description = shape_config(family, name)
            assert config.model_type == family and description.startswith(shape.checkpoint)
    config, description = shape_config("qwen3_5_text", "0.8b", layers=8)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert "first 8 of 24 layers" in description
    with pytest.raises(ValueError, match="known shapes"):
        shape_config("qwen3_5_text", "9b")


def test_shared_tier_runs_two_workers_on_a_real_server(capsys):
    """``shared_tier.py``: its own redis-server, worker processes, identical first tokens (it asserts them) and the
    tier serving the second worker what the first published."""
    from benchmarks import shared_tier
    from redis_server import require_redis

    require_redis()
    shared_tier.main(["--workloads", "a_system_prompt", "--workers", "2", "--requests", "3"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| a_system")]
    assert [row[1] for row in rows] == ["1 worker", "2 workers, local", "2 workers + tier"]
    hit_rate = {row[1]: float(row[3]) for row in rows}
    assert hit_rate["2 workers + tier"] == hit_rate["1 worker"] > hit_rate["2 workers, local"]


def test_concurrency_runs_every_way_of_serving_on_a_tiny_model(tmp_path, capsys):
    """``concurrency.py --tiny``: one row per way of serving, the same token hit rate for every way that uses the
    cache, a plot."""
    from benchmarks import concurrency

    rows = concurrency.main(["--tiny", "--models", "jamba", "--workloads", "b", "--levels", "2", "--arrivals",
                             "poisson", "--rate", "50", "--out", str(tmp_path)])
    assert [row["method"] for row in rows] == list(concurrency.METHODS)
    cached = {round(row["hit_rate"], 6) for row in rows if row["method"] != "stock"}
    assert len(cached) == 1 and cached.pop() > 0
    assert "| 2 | engine |" in capsys.readouterr().out
    assert (tmp_path / "concurrency_jamba_b_poisson.png").exists()


def test_hit_overhead_runs_on_a_tiny_shape(capsys):
    """``hit_overhead.py``: stock and hit in lockstep give the same tokens; the restore sweep has one row per prefix."""
    from benchmarks import hit_overhead

    hit_overhead.main(["--kinds", "gdn", "--shapes", "tiny", "--prefixes", "64", "--restore-prefixes", "64", "128",
                       "--suffix-tokens", "16", "--decode-tokens", "2", "--repeats", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| gdn")]
    compared, restored = [r for r in rows if len(r) == 15], [r for r in rows if len(r) == 10]
    assert compared and all(r[-1].strip() == "yes" and float(r[-2]) < 1e-4 for r in compared)
    assert [int(r[1]) for r in restored] == [64, 128] and all(float(r[3]) > 0 for r in restored)
    assert all(float(r[7]) > 0 for r in restored)  # the copy floor of the same bytes


def test_serve_multiturn_runs_its_servers_on_a_tiny_model(capsys):
    """``serve_multiturn.py`` with ``--speculative ngram``: the three servers start from the saved model, the table
    has a row per level and server, the replies of each server equal the stock server's, and the token hit rates
    with and without speculation are equal turn by turn (one client: with several, which of two requests sent at
    once hits what the other stores depends on when each reaches the engine, with or without speculation)."""
    from benchmarks import serve_multiturn

    serve_multiturn.main(["--clients", "1", "--turns", "2", "--max-tokens", "4", "--system-repeats", "1",
                          "--shape", "tiny", "--speculative", "ngram"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith(("| 1 | stock", "| 1 | hf_"))]
    assert [row.split(" | ")[1] for row in rows] == ["stock", "hf_hybridcache", serve_multiturn.SPECULATIVE]
    assert rows[1].endswith("| yes |") and rows[2].endswith("| yes |")
    header = next(i for i, line in enumerate(lines) if line.endswith("| difference |"))
    turns = lines[header + 2 : header + 4]
    assert len(turns) == 2 and all(row.endswith("| 0.0000 |") for row in turns), turns


def test_grammar_masks_runs_for_llguidance(capsys):
    """``grammar_masks.py`` on the toy vocabulary with llguidance (the other libraries are not dependencies): a row of
    timings and every random walk's JSON parses."""
    pytest.importorskip("llguidance")
    from benchmarks import grammar_masks

    grammar_masks.main(["--vocabs", "262", "--libraries", "llguidance", "--steps", "8", "--walks", "5"])
    out = capsys.readouterr().out
    assert "| 262 | llguidance |" in out and "- llguidance: 5 of 5" in out


def test_step_profile_splits_a_step_on_a_toy_model(capsys):
    """``step_profile.py`` on the toy Jamba: every phase's row and the engine / stock ratio, for 1 and 2 requests."""
    from benchmarks import step_profile

    step_profile.main(["--models", "toy:jamba", "--running", "1", "2", "--steps", "2"])
    out = capsys.readouterr().out
    for row in ("| forward: Mamba mixer |", "| forward: attention |", "| sampling |", "| store |", "| engine / stock |"):
        assert row in out, out


def test_step_profile_times_verify_steps_that_keep_every_draft(capsys):
    """``step_profile.py --speculative 3``: each timed step is a verify step whose 3 drafts are all kept (4 tokens a
    request a step, 1 and 2 requests), with the linear layers' share and the per-token rows."""
    from benchmarks import step_profile

    step_profile.main(["--models", "toy:jamba", "--running", "1", "2", "--steps", "2", "--speculative", "3"])
    out = capsys.readouterr().out
    assert "ms per verify step (3 drafts a request, all kept)" in out, out
    assert "| tokens a request got per step | 4.00 | 4.00 |" in out, out
    for row in ("| of which: linear layers |", "| engine step per token |", "| engine per token / stock |"):
        assert row in out, out


def test_speculative_multiturn_runs_and_every_turn_equals_greedy(capsys):
    """``speculative_multiturn.py``: a turn after the first restores the chat so far, and every way of speculating
    (transformers' own rollback where it has one, the package with and without reuse) equals plain greedy."""
    from benchmarks import speculative_multiturn

    rows = speculative_multiturn.main(["--turns", "2", "--repeats", "1", "--new-tokens", "8",
                                       "--document-repeats", "1"])
    assert [row["turn"] for row in rows] == [1, 2]
    assert rows[0]["hit_tokens"] == 0 and rows[1]["hit_tokens"] >= rows[0]["prompt_tokens"] - 16
    assert all(row["cached_identical"] and row["native_identical"] in (True, None) for row in rows)
    assert "| turn | prompt tokens | hit tokens |" in capsys.readouterr().out


def test_engine_speculative_runs_every_way_and_each_equals_the_plain_run(capsys):
    """``engine_speculative.py`` on the toy, 1 and 2 streams: every way's tokens equal the plain engine's and the
    ceiling keeps every draft."""
    from benchmarks import engine_speculative

    rows = engine_speculative.main(["--streams", "1", "2", "--new-tokens", "8", "--prompt-tokens", "20",
                                    "--repeats", "1", "--rates", "0.5", "--draft-model"])
    assert {row["way"] for row in rows} == {"plain", "ceiling k=4", "rate 0.5 k=4", "draft model k=4", "ngram k=4"}
    assert all(row["identical"] for row in rows)
    assert all(row["accepted"] == 1.0 for row in rows if row["way"] == "ceiling k=4")
    assert "| text | 2 | ceiling k=4 | 1.00 |" in capsys.readouterr().out


def test_vs_llama_cpp_speculative_replays_every_draft_through_our_server_and_builds_llama_servers_commands(
        tmp_path, capsys):
    """``vs_llama_cpp_speculative.py`` without llama.cpp: our plain and replaying servers (``replay_server.py``) on the
    toy Jamba saved for both servers give the same greedy replies, the replaying one with every draft accepted by
    its own ``/metrics``; llama-server's commands carry the synthetic rates r^i; the tables print."""
    from benchmarks import llama_cpp
    from benchmarks import vs_llama_cpp_speculative as bench

    llama_cpp.save_for_gguf(build_model("jamba", seed=0), tmp_path / "model")
    prompts = ["".join(chr(0x4E10 + (7 * i + j) % 200) for j in range(20)) for i in range(2)]
    paths = {"model": tmp_path / "model", "prompts": tmp_path / "prompts.json", "llama_server": "/bin/llama-server",
             "gguf": tmp_path / "model.gguf", "draft_gguf": tmp_path / "draft.gguf"}
    paths["prompts"].write_text(json.dumps(prompts))
    args = bench.parse_args(["--max-tokens", "12", "--rounds", "1", "--rates", "1.0", "0.5"])
    results = bench.run_ways(["ours plain", "ours replay 1.0"], paths, prompts, args, None)
    assert results["ours replay 1.0"]["texts"] == results["ours plain"]["texts"]
    assert [len(text) for text in results["ours plain"]["texts"]] == [12]  # one character per token, no early end
    assert results["ours replay 1.0"]["accepted"] == 1.0 and results["ours plain"]["accepted"] is None
    assert all(len(result["samples"]) == 1 for result in results.values())
    synth = bench.command("llama synth 0.5", paths, 8080, args)
    assert synth[synth.index("--spec-synth-rates") + 1] == "0.5,0.25,0.125,0.0625"
    assert synth[synth.index("-md") + 1] == str(paths["draft_gguf"])
    assert synth[synth.index("--spec-draft-n-min") + 1] == synth[synth.index("--spec-draft-n-max") + 1] == "4"
    assert "--spec-type" not in bench.command("llama plain", paths, 8080, args)
    bench.print_tables(results, args, "toy")
    out = capsys.readouterr().out
    assert "| ours replay 1.0 | 1.00 |" in out and "| ours replay 1.0 / ours plain |" in out

    # --streams 2: both measured prompts at once, each still every draft kept and the plain reply; llama-server
    # gets two slots
    prompts.append("".join(chr(0x4E10 + (5 * j) % 200) for j in range(20)))
    paths["prompts"].write_text(json.dumps(prompts))
    args = bench.parse_args(["--max-tokens", "12", "--rounds", "1", "--rates", "1.0", "--streams", "2"])
    results = bench.run_ways(["ours plain", "ours replay 1.0"], paths, prompts, args, None)
    assert [len(texts) for texts in results["ours plain"]["texts"][0]] == [12, 12]
    assert results["ours replay 1.0"]["texts"] == results["ours plain"]["texts"]
    assert results["ours replay 1.0"]["accepted"] == 1.0
    assert all(len(result["samples"]) == 1 for result in results.values())
    plain = bench.command("llama plain", paths, 8080, args)
    assert plain[plain.index("-np") + 1] == "2"
    bench.print_tables(results, args, "toy")
    assert "2 streams at once" in capsys.readouterr().out


@pytest.mark.skipif(not os.environ.get("HF_HYBRIDCACHE_LLAMA_SERVER"), reason="HF_HYBRIDCACHE_LLAMA_SERVER names no "
                    "llama-server binary (built in a llama.cpp tree: benchmarks/llama_cpp.py says how)")
def test_vs_llama_cpp_speculative_against_llama_server(tmp_path, capsys):
    """The whole harness, one short round, against a real llama-server: its synthetic acceptance of 1 and ours both
    keep every draft, by their own counters."""
    from benchmarks import vs_llama_cpp_speculative as bench

    results = bench.main(["--llama-server", os.environ["HF_HYBRIDCACHE_LLAMA_SERVER"], "--work-dir", str(tmp_path),
                          "--rounds", "1", "--prompts", "1", "--max-tokens", "16", "--rates", "1.0"])
    assert results["ours replay 1.0"]["accepted"] == results["llama synth 1.0"]["accepted"] == 1.0
    assert "| ours replay 1.0 / llama synth 1.0 |" in capsys.readouterr().out


def test_batch_invariance_prints_every_table_and_the_invariant_rows_are_all_equal(capsys):
    """``batch_invariance.py`` (issue 46): tables 1-4 print, and the rows of the package's invariant linear, Mamba-1
    and Mamba-2 scans and conv say ``=`` in every cell (every row count, prefill vs decode, every split)."""
    from benchmarks import batch_invariance

    batch_invariance.main(["--no-costs"])
    out = capsys.readouterr().out
    for title in ("## 1. linear", "## 2. row-wise", "## 3. attention", "## 4. recurrent"):
        assert title in out, out
    ours = ("| invariant_linear", "| Mamba-1 selective_scan_invariant", "| Mamba-2 mamba2_scan_invariant",
            "| causal_conv_invariant")
    invariant = [line for line in out.splitlines() if line.startswith(ours)]
    assert len(invariant) == 15, out
    assert all(set(line.split("|")[2:-1]) == {" = "} for line in invariant), invariant


def test_grpo_rollouts_runs_both_ways_on_a_tiny_shape(capsys):
    """``grpo_rollouts.py``: TRL's GRPO trainer both ways (the engine through ``attach``, TRL's own ``generate()``
    path), the engine computing each prompt once ((G - 1) / G of it restored), and the weights state per step."""
    pytest.importorskip("trl", reason="needs TRL: pip install -e '.[dev]'")
    from benchmarks import grpo_rollouts

    rows, identity = grpo_rollouts.main(["--shape", "qwen3_5_text:tiny", "--identity-shape", "qwen3_5_text:tiny",
                                         "--prompt-tokens", "100", "--completion-tokens", "4", "--steps", "2",
                                         "--identity-step-tokens", "8"])
    engine, plain = rows
    assert (engine["way"], plain["way"]) == ("engine", "generate") and engine["steps"] == plain["steps"] == 2
    assert engine["hit share"] == pytest.approx(7 / 8) and plain["hit share"] == 0.0  # G = 8: 7 of 8 restore it
    assert plain["x rollout"] == 1.0 and engine["x rollout"] > 0
    assert float(identity["declared ms"]) >= 0 and identity["declared/step"].endswith("%")
    out = capsys.readouterr().out
    assert "| way " in out and "| engine " in out and "| identity s " in out
