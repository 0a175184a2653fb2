"""The README's "Use it with your checkpoint" recipe runs as written on a locally saved model, in bf16, and every
reply equals the same loop run without the cache."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hybridcache import CACHE_KWARG
from hf_hybridcache.toy import build_model, byte_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def recipe() -> str:
    """The first python block under the README's "Use it with your checkpoint" heading."""
    text = README.read_text()
    section = text[text.index("## Use it with your checkpoint") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    """A small Jamba and a byte-level tokenizer with a chat template, saved as a checkpoint folder is."""
    path = tmp_path_factory.mktemp("checkpoint")
    build_model("jamba", seed=0).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_the_recipe_runs_as_written_in_bf16_and_equals_the_loop_without_the_cache(saved_model, capsys):
    code = recipe()
    code, paths = re.subn(r'^path = "[^"]*"', f'path = "{saved_model}"', code, flags=re.M)
    assert paths == 1, "the recipe names its checkpoint on one `path = ...` line"
    if CACHE_KWARG != "cache":  # the spelling the recipe's comment gives for transformers 5.23
        code = code.replace("cache=cache", f"{CACHE_KWARG}=cache")
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)

    model, messages, replies = scope["model"], scope["messages"], scope["replies"]
    assert model.dtype == torch.bfloat16 and len(replies) == 3
    printed = capsys.readouterr().out
    hits = [int(h) for h in re.findall(r"turn \d: (\d+) of \d+ prompt tokens restored", printed)]
    assert hits[0] == 0 and all(hit > 0 for hit in hits[1:]), printed  # later turns restore the chat so far

    # The same loop without the cache, on a fresh load of the same checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    cold = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.bfloat16, device_map="auto").eval()
    user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for turn, (end, reply) in enumerate(zip(user_turns, replies)):
        inputs = tokenizer.apply_chat_template(messages[: end + 1], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(cold.device)
        out = cold.generate(**inputs, max_new_tokens=48, do_sample=False)
        assert torch.equal(out[0, inputs["input_ids"].shape[1] :], reply), f"turn {turn + 1} differs"
