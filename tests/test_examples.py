"""The batch and prompt-lookup examples run (small settings) and report identical outputs."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_batch_example():
    result = load("batch").main(["--new-tokens", "6"])
    assert all(result["identical"])
    assert result["hits"][0] > 0 and result["hits"][1] > 0 and result["hits"][2] > 0


def test_prompt_lookup_example():
    result = load("prompt_lookup").main(["--new-tokens", "48", "--repeats", "1"])
    assert result["identical"]
    assert set(result["speedups"]) == {3, 10}
