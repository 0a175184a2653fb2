"""The README's "Use it with your checkpoint" recipe runs as written on a locally saved model, in bf16, and every
reply equals the same loop run without the cache; and what the README says about the docs, installing and the test
run's skip tally holds."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_hybridcache import CACHE_KWARG
from hf_hybridcache.toy import build_model, byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


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
    turns = [(int(h), int(n)) for h, n in re.findall(r"turn \d: (\d+) of (\d+) prompt tokens restored", printed)]
    assert turns[0][0] == 0 and all(hit > 0 for hit, _ in turns[1:]), printed  # later turns restore the chat so far
    (hit2, len2), (hit3, len3) = turns[1:]
    stated = f"turns 2 and 3 restore {hit2} of {len2} and {hit3} of {len3} prompt tokens"
    assert stated in " ".join(README.read_text().split()), f"the README should say: {stated}"

    # The same loop without the cache, on a fresh load of the same checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(saved_model)
    cold = AutoModelForCausalLM.from_pretrained(saved_model, dtype=torch.bfloat16, device_map="auto").eval()
    user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for turn, (end, reply) in enumerate(zip(user_turns, replies)):
        inputs = tokenizer.apply_chat_template(messages[: end + 1], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True).to(cold.device)
        out = cold.generate(**inputs, max_new_tokens=48, do_sample=False)
        assert torch.equal(out[0, inputs["input_ids"].shape[1] :], reply), f"turn {turn + 1} differs"


def test_every_docs_page_is_linked_from_the_readme():
    """A reader who starts at the README can reach every page (docs/scale-out.md was once linked from nowhere)."""
    text = README.read_text()
    pages = sorted(f"docs/{path.name}" for path in (ROOT / "docs").glob("*.md"))
    assert [page for page in pages if f"]({page}" not in text] == []


def test_install_lines_install_from_a_clone():
    """hf_hybridcache is not on PyPI: no README, docs page, example or error message tells anyone to
    ``pip install 'hf_hybridcache[...]'`` (the extras install with ``pip install -e '.[...]'`` in a clone)."""
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.*"),
             *(ROOT / "hf_hybridcache").rglob("*.py")]
    from_pypi = re.compile(r"pip install ['\"]?hf_hybridcache\b")
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in texts if path.suffix in (".md", ".py")
             for line in path.read_text(encoding="utf-8").splitlines() if from_pypi.search(line)]
    assert found == []


def test_the_skip_tally_sits_where_the_readme_says(tmp_path):
    """The README: "Above pytest's closing summary, a line `N skipped, by reason: ...`". With a failure in the run the
    tally is not the last line: it comes before pytest's short summary of failures and its final counts."""
    assert "Above pytest's closing summary, a line `N skipped, by reason: ...`" in README.read_text()
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "suite = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(suite)\n"
        "pytest_terminal_summary = suite.pytest_terminal_summary\n")
    (tmp_path / "test_tally.py").write_text(
        "import pytest\n\n\ndef test_fails():\n    assert False\n\n\n"
        "@pytest.mark.skip(reason='needs a thing: install it')\ndef test_skips():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "."],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests")})
    lines = done.stdout.splitlines()
    tally = lines.index("1 skipped, by reason: 1 x needs a thing: install it")
    assert "short test summary info" in lines[tally + 1], done.stdout
    assert lines[-1].startswith("1 failed, 1 skipped"), done.stdout
