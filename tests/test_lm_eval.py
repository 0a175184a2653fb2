"""EleutherAI's lm-evaluation-harness against the server: ``lm_eval --model local-completions`` pointed at
``python -m hf_hybridcache.serve --model DIR`` scores a multiple-choice task (loglikelihood; every prompt starts with
one long description, so the prefix cache hits) and a ``generate_until`` task exactly as ``lm_eval --model hf``
scores the same saved model: every sample's loglikelihood within 1e-3, the same ``is_greedy``, identical generations,
identical metrics (fp32); the server's hit counter is above 0 after the run.

The model and byte tokenizer are built in code and saved with ``save_pretrained``; the tasks are local YAML files over
JSON data (``datasets``' json loader); nothing is downloaded. The client sends 4 prompts per request (a list of
token-id lists, each its own engine request). Three choices of each question share a long start, so later ones restore
a checkpoint inside their continuation and its kept logprobs (a broken restore of those changes the scores the harness
sums; a restore inside the context alone would not). One choice is the model's own greedy continuation of its context
where it is printable, so ``is_greedy`` is True for some samples and compared, not only False everywhere."""

import glob
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from hf_hybridcache.toy import build_model, byte_tokenizer

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness: pip install 'lm-eval[api]' (in .[dev])")

DESCRIPTION = ("You are taking a short arithmetic quiz. Read each question, think about the numbers it gives, and "
               "choose the one answer that is correct. Answers are numbers, words or single characters. ")
QUESTIONS = [(2, 3), (7, 5), (4, 9), (6, 6), (8, 1), (3, 3), (9, 4), (5, 7)]
SURE = " I am quite sure that it is "
LOGLIKELIHOOD_TOL = 1e-3
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def greedy_text(model, tokenizer, context: str, num_tokens: int) -> str | None:
    """The model's greedy continuation of ``context`` as text, when it is printable and re-encodes to the same ids
    after the context (so that the harness scores exactly those tokens); else None."""
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    continuation = out[0, len(ids):].tolist()
    text = tokenizer.decode(continuation)
    if not text.isprintable() or tokenizer(context + text, add_special_tokens=False)["input_ids"] != ids + continuation:
        return None
    return text


def write_tasks(folder: Path, model, tokenizer) -> int:
    """The two tasks' YAML and JSON files in ``folder``; returns how many choices are the model's greedy text."""
    docs, greedy_choices = [], 0
    for a, b in QUESTIONS:
        text = f"Question: What is {a} plus {b}?\nAnswer:"
        # Three choices share their first 29 tokens: a later one restores a checkpoint inside them, and with it
        # logprobs of its continuation that the cache kept, not only of its context.
        choices = [f"{SURE}{n}" for n in (a + b, a + b + 1, a * b + 10)] + [" none"]
        greedy = greedy_text(model, tokenizer, DESCRIPTION + text, 2) or greedy_text(model, tokenizer,
                                                                                    DESCRIPTION + text, 1)
        if greedy is not None and greedy not in choices:
            choices[3], greedy_choices = greedy, greedy_choices + 1
        docs.append({"text": text, "choices": choices, "answer": (a * b) % 4})
    (folder / "mc.json").write_text("".join(json.dumps(d) + "\n" for d in docs))
    prompts = [{"question": f"Name a colour, number {i}.\nColour:", "answer": "red"} for i in range(4)]
    (folder / "gen.json").write_text("".join(json.dumps(d) + "\n" for d in prompts))
    common = f"dataset_path: json\ntest_split: test\ndescription: {json.dumps(DESCRIPTION)}\n"
    (folder / "hfhc_mc.yaml").write_text(
        f"task: hfhc_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.json'}\n"
        "output_type: multiple_choice\ndoc_to_text: text\ndoc_to_choice: choices\ndoc_to_target: answer\n"
        'target_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n')
    (folder / "hfhc_gen.yaml").write_text(
        f"task: hfhc_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.json'}\n"
        "output_type: generate_until\ndoc_to_text: question\ndoc_to_target: answer\n"
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")
    return greedy_choices


def lm_eval(model: str, model_args: str, tasks: Path, output: Path, batch_size: int, env: dict,
            *extra: str) -> subprocess.Popen:
    command = Path(sys.executable).with_name("lm_eval")
    args = [str(command)] if command.exists() else [sys.executable, "-m", "lm_eval"]
    return subprocess.Popen(
        [*args, "--model", model, "--model_args", model_args, "--tasks", "hfhc_mc,hfhc_gen", "--include_path",
         str(tasks), "--batch_size", str(batch_size), "--output_path", str(output), "--log_samples", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finished(process: subprocess.Popen, timeout: float) -> str:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, out[-4000:]
    return out


def table(out: str) -> str:
    """The results table lm_eval prints (its last lines)."""
    return "\n".join(line for line in out.splitlines() if line.startswith(("|", "hf (", "local-completions")))


def samples(output: Path, task: str) -> dict[int, dict]:
    (path,) = glob.glob(str(output / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    return {s["doc_id"]: s for s in map(json.loads, Path(path).read_text().splitlines())}


def results(output: Path) -> dict:
    (path,) = glob.glob(str(output / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(path).read_text())["results"]


def start_server(folder: Path, port: int, env: dict) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "hf_hybridcache.serve", "--model", str(folder), "--port",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    return server


def wait_healthy(server: subprocess.Popen, url: str, deadline_s: float = 180) -> None:
    deadline = time.time() + deadline_s
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert server.poll() is None, f"the server exited: {server.stderr.read()[-3000:]}"
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.3)


def counters(url: str) -> dict[str, float]:
    """The server's counters of prompt tokens and of prompt tokens restored from the cache."""
    names = ("hf_hybridcache_prompt_tokens_total", "hf_hybridcache_hit_tokens_total")
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {name: float(line.split()[1]) for line in lines for name in names if line.startswith(name + " ")}


def test_lm_eval_through_the_server_scores_as_the_hf_model(tmp_path):
    model_dir, tasks = tmp_path / "model", tmp_path / "tasks"
    tasks.mkdir()
    model, tokenizer = build_model("jamba", seed=0), byte_tokenizer()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    greedy_choices = write_tasks(tasks, model, tokenizer)
    assert greedy_choices >= 2, "too few choices are the model's greedy text for is_greedy to be compared"
    env = {**ENV, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = start_server(model_dir, port, env)
    try:
        reference = lm_eval("hf", f"pretrained={model_dir},dtype=float32", tasks, tmp_path / "hf", 1, env,
                            "--device", "cpu")
        hf_out = finished(reference, 300)
        wait_healthy(server, url)
        api_args = (f"base_url={url}/v1/completions,model={model_dir},tokenizer={model_dir},"
                    "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
        api_out = finished(lm_eval("local-completions", api_args, tasks, tmp_path / "api", 4, env), 300)
        served = counters(url)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"\nlm_eval --model hf:\n{table(hf_out)}\n\nlm_eval --model local-completions (this server):\n"
          f"{table(api_out)}")

    worst, greedy_samples = 0.0, 0
    hf_mc, api_mc = samples(tmp_path / "hf", "hfhc_mc"), samples(tmp_path / "api", "hfhc_mc")
    assert sorted(hf_mc) == sorted(api_mc) == list(range(len(QUESTIONS)))
    print("\ndoc  choice  hf loglikelihood  server loglikelihood  |diff|  is_greedy (hf, server)")
    for doc_id in sorted(hf_mc):
        for choice, (hf_resp, api_resp) in enumerate(zip(hf_mc[doc_id]["resps"], api_mc[doc_id]["resps"],
                                                         strict=True)):
            (hf_ll, hf_greedy), (api_ll, api_greedy) = hf_resp[0], api_resp[0]
            diff = abs(float(hf_ll) - float(api_ll))
            worst, greedy_samples = max(worst, diff), greedy_samples + (hf_greedy == "True")
            print(f"{doc_id:>3}  {choice:>6}  {float(hf_ll):>16.6f}  {float(api_ll):>20.6f}  {diff:.1e}  "
                  f"{hf_greedy}, {api_greedy}")
            assert diff < LOGLIKELIHOOD_TOL and hf_greedy == api_greedy, (doc_id, choice, hf_resp, api_resp)
    hf_gen, api_gen = samples(tmp_path / "hf", "hfhc_gen"), samples(tmp_path / "api", "hfhc_gen")
    for doc_id in sorted(hf_gen):
        print(f"generation {doc_id}: hf {hf_gen[doc_id]['resps'][0]!r} server {api_gen[doc_id]['resps'][0]!r}")
        assert hf_gen[doc_id]["resps"] == api_gen[doc_id]["resps"], doc_id
        assert hf_gen[doc_id]["filtered_resps"] == api_gen[doc_id]["filtered_resps"], doc_id
    hits, prompt_tokens = served["hf_hybridcache_hit_tokens_total"], served["hf_hybridcache_prompt_tokens_total"]
    print(f"max |loglikelihood diff| {worst:.2e}; is_greedy True in {greedy_samples} samples; the server restored "
          f"{hits:.0f} of {prompt_tokens:.0f} prompt tokens from the cache")
    assert greedy_samples >= 2 and hits > 0
    assert results(tmp_path / "hf") == results(tmp_path / "api")
