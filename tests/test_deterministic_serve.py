"""``python -m hf_hybridcache.serve --deterministic`` (issue 46) through the real ``openai`` client: a completion's text
and logprobs are the same bits alone, among concurrent requests and after its prefix was stored, in float32 and
bfloat16, on every family the mode accepts; a model the mode cannot hold for, or
``--no-cache``, is refused at startup. Power: without ``--deterministic`` the float32 completions differ between alone
and concurrent (Mamba's bfloat16 ones agreed on this bank; Mamba-2's differ in both dtypes, concurrent and after a
hit; Qwen3.5's differ concurrent in both dtypes and after a hit in float32)."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve import Server

from hf_hybridcache.models.deterministic import SUPPORTED
from hf_hybridcache.serve.__main__ import make_app, parse_args
from hf_hybridcache.toy import build_model, byte_tokenizer

PROMPTS = ["The deterministic mode of a state-space model ", "ab", "Prefix caching for hybrids " * 3,
           "The deterministic mode of a state-space model serves ", "xyz" * 11, "0123456789"]


def _complete(client, prompt: str, model: str) -> tuple[str, list[float]]:
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    return reply.choices[0].text, reply.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize("family", sorted(SUPPORTED))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_completions_are_bitwise_alone_concurrent_and_after_a_hit(dtype, family):
    model = f"toy:{family}"
    server = Server(make_app(parse_args(["--model", model, "--dtype", dtype, "--deterministic"])))
    try:
        client = server.client()
        alone = [_complete(client, prompt, model) for prompt in PROMPTS]  # the 4th hits the 1st's stored prefix
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda prompt: _complete(server.client(), prompt, model), PROMPTS))
        assert together == alone
        assert [_complete(client, prompt, model) for prompt in reversed(PROMPTS)] == alone[::-1]
        assert httpx.get(f"{server.url}/server_info").json()["deterministic"] is True
    finally:
        server.close()


def test_deterministic_startup_refusals(tmp_path):
    """A model the mode refuses (every toy family is accepted: a saved Qwen3.5 with GELU MLPs) and --no-cache."""
    build_model("qwen3_5_text", seed=0, hidden_act="gelu").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="(?s)hidden_act='gelu'.*deterministic=False"):
        make_app(parse_args(["--model", str(tmp_path), "--deterministic"]))
    with pytest.raises(ValueError, match="drop --no-cache"):
        make_app(parse_args(["--model", "toy:mamba", "--deterministic", "--no-cache"]))
