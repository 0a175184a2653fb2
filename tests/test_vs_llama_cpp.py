"""``benchmarks/vs_llama_cpp.py``'s parts that need no llama.cpp: the tokenizer and config the converter is given,
the workloads against our server, the ratio table and the arguments. The whole harness against ``llama-server`` runs
only when ``HF_HYBRIDCACHE_LLAMA_SERVER`` names a binary built in a llama.cpp tree (CI does not build llama.cpp)."""

import json
import os
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from benchmarks import llama_cpp, vs_llama_cpp
from hf_hybridcache.toy import build_model

LLAMA_SERVER = os.environ.get("HF_HYBRIDCACHE_LLAMA_SERVER")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The toy Jamba (one expert) saved for both servers."""
    path = tmp_path_factory.mktemp("model")
    model = build_model("jamba", seed=0)
    llama_cpp.save_for_gguf(model, path)
    return model, path


def test_the_saved_tokenizer_is_one_token_per_character_in_the_form_the_converter_takes(saved):
    model, path = saved
    tokenizer = AutoTokenizer.from_pretrained(path)
    alphabet = llama_cpp.text_alphabet(tokenizer)
    assert len(alphabet) == model.config.vocab_size - 6
    text = "".join(alphabet[i] for i in (0, 17, 3, 255))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [6, 23, 9, 261] and tokenizer.decode(ids) == text
    markers = llama_cpp.letters(3)
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": text}, {"role": "user", "content": text}],
                                             tokenize=False, add_generation_prompt=True)
    assert rendered == markers[0] + text + markers[1] + text + markers[2]
    # What gguf.LlamaHfVocab requires of tokenizer.json (else it refuses the model), and no BOS from either server.
    backend = json.loads((path / "tokenizer.json").read_text())
    assert backend["model"]["type"] == "BPE" and backend["model"]["byte_fallback"]
    assert backend["decoder"]["type"] == "Sequence"
    assert [backend["model"]["vocab"][t] for t in llama_cpp.SPECIAL_TOKENS] == [0, 1, 2]
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["add_eos_token"] is False


def test_the_config_details_llama_cpp_needs(saved):
    """One expert: ``num_experts_per_tok`` 1 (llama.cpp refuses more than the experts); the special ids' LM-head rows
    zero, so greedy never ends a reply early."""
    model, path = saved
    config = json.loads((path / "config.json").read_text())
    assert config["num_experts"] == 1 and config["num_experts_per_tok"] == 1
    head = model.get_output_embeddings().weight
    assert torch.count_nonzero(head[:3]) == 0 and torch.count_nonzero(head[3:]) == head[3:].numel()


def test_a_vocabulary_without_room_for_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no text alphabet"):
        llama_cpp.save_for_gguf(build_model("jamba", vocab_size=12), tmp_path)


def test_texts_are_seeded_and_drawn_from_the_alphabet():
    texts = vs_llama_cpp.Texts(list("abc"), seed=0)
    assert texts("x", 50) == texts("x", 50) != texts("y", 50) and set(texts("x", 50)) <= set("abc")
    assert vs_llama_cpp.Texts(list("abc"), seed=1)("x", 50) != texts("x", 50)


def test_every_workload_runs_against_our_server(saved):
    """The workloads' metrics against ``python -m hf_hybridcache.serve`` on small sizes (one server process)."""
    _, path = saved
    args = vs_llama_cpp.parse_args(["--turns", "2", "--max-tokens", "3", "--prefix-tokens", "64",
                                    "--question-tokens", "8", "--prefill-tokens", "80"])
    texts = vs_llama_cpp.Texts(llama_cpp.text_alphabet(AutoTokenizer.from_pretrained(path)), 0)
    with vs_llama_cpp.serving("hf_hybridcache", {"model": path}, 8, None) as url:
        chat = vs_llama_cpp.run_workload(vs_llama_cpp.WORKLOADS["chat8"], url, texts, args)
        shared = vs_llama_cpp.run_workload(vs_llama_cpp.WORKLOADS["shared8"], url, texts, args)
        prefill = vs_llama_cpp.run_workload(vs_llama_cpp.WORKLOADS["prefill"], url, texts, args)
    assert chat["first_prompt_tokens"] == 64 and len(chat["texts"]) == 8
    assert all(len(reply) == 3 for replies in chat["texts"] for reply in replies)  # no reply ends early
    assert chat["tokens_per_s"] > 0 and chat["first_ttft"] > 0 and chat["ttft_later"] > 0
    assert len(shared["texts"]) == 8 and shared["tokens_per_s"] > 0 and shared["ttft_p50"] > 0
    assert prefill["prefill_tokens"] == 80 and prefill["prefill_per_s"] > 0


def test_ratios_are_medians_of_per_round_ratios_and_say_which_server_wins(capsys):
    rounds = {"hf_hybridcache": [{"tokens_per_s": 30.0, "ttft_p50": 0.5}, {"tokens_per_s": 10.0, "ttft_p50": 0.75},
                                 {"tokens_per_s": 20.0, "ttft_p50": 0.25}],
              "llama-server": [{"tokens_per_s": 10.0, "ttft_p50": 4.0}, {"tokens_per_s": 20.0, "ttft_p50": 6.0},
                               {"tokens_per_s": 40.0, "ttft_p50": 2.0}]}
    rows = vs_llama_cpp.ratio_rows({"shared8": rounds})
    assert [(r["metric"], r["ratios"], r["ratio"], r["favours"]) for r in rows] == [
        ("tokens/s", [3.0, 0.5, 0.5], 0.5, "llama-server"), ("TTFT p50 (s)", [0.125, 0.125, 0.125], 0.125, "hf_hybridcache")]
    assert rows[0]["ours"] == 20.0 and rows[0]["theirs"] == statistics.median([10.0, 20.0, 40.0])
    vs_llama_cpp.print_results({"shared8": rounds}, vs_llama_cpp.parse_args(["--rounds", "3"]), "toy")
    assert "| 8 requests, shared 1,024-token prefix seen before | tokens/s | 20.00 | 20.00 | 0.50x | 3.00 0.50 0.50 " \
           "| llama-server |" in capsys.readouterr().out


def test_arguments():
    args = vs_llama_cpp.parse_args([])
    assert args.shape == "toy" and args.workloads == list(vs_llama_cpp.WORKLOADS) and args.rounds == 3
    assert args.llama_server is None and Path(args.llama_cpp_dir) == llama_cpp.DEFAULT_DIR
    with pytest.raises(SystemExit):
        vs_llama_cpp.parse_args(["--workloads", "chat3"])
    with pytest.raises(SystemExit):
        vs_llama_cpp.parse_args(["--rounds", "0"])
    command = llama_cpp.llama_server_command("/bin/llama-server", "m.gguf", 8080, parallel=8)
    assert command[command.index("-np") + 1] == "8" and command[command.index("-c") + 1] == str(8 * 4096)
    assert command[command.index("-t") + 1] == "2"


@pytest.mark.skipif(not LLAMA_SERVER, reason="HF_HYBRIDCACHE_LLAMA_SERVER names no llama-server binary (built in a "
                    "llama.cpp tree: benchmarks/llama_cpp.py says how)")
def test_against_llama_server(tmp_path, capsys):
    """Conversion, agreement and one round of the single-stream workloads against a real llama-server."""
    vs_llama_cpp.main(["--llama-server", LLAMA_SERVER, "--work-dir", str(tmp_path), "--rounds", "1", "--workloads",
                       "chat1", "prefill", "--turns", "2", "--max-tokens", "4", "--prefix-tokens", "128",
                       "--prefill-tokens", "128", "--agree-prompts", "8", "64", "--agree-tokens", "8"])
    out = capsys.readouterr().out
    assert "| 8 | " in out and "| 6-turn chat, 1 client | tokens/s |" in out and "| cold prefill, one prompt |" in out


def test_reply_gaps_are_taken_where_each_client_first_differs(saved):
    """A chat client and a completion client whose replies differ: the gap is the model's top-2 logit gap after the
    prompt (the chat template rendered for a chat) and the common start of the reply."""
    model, path = saved
    tokenizer = AutoTokenizer.from_pretrained(path)
    a, b, c = llama_cpp.text_alphabet(tokenizer)[:3]
    messages = [{"role": "user", "content": a + b}]
    ours = {"sent": [[messages, messages], [a * 5]], "texts": [[a, b + a + c], [c + c]]}
    theirs = {"texts": [[a, b + b + c], [c + c]]}
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert vs_llama_cpp.reply_gaps(model, tokenizer, ours, theirs) == [
        vs_llama_cpp.top2_gap(model, tokenizer, rendered + b)]
    assert vs_llama_cpp.shown_gap((1e-3, 4.0)) == "1.0e-03 of 4.00 (near-tie)"
    assert vs_llama_cpp.shown_gap((1e-2, 4.0)) == "1.0e-02 of 4.00"
