"""Shared pieces of the continuous-batching tests: prompts, the reference (each request alone with generate() and no
cache), and a manager that streams."""

import torch
from conftest import random_ids
from transformers import GenerationConfig

GREEDY = dict(do_sample=False, pad_token_id=0)


def ids(length: int, seed: int) -> list[int]:
    return random_ids(length, seed)[0].tolist()


def alone(cold_model, prompt: list[int], max_new_tokens: int, eos_token_id=None) -> list[int]:
    """The request alone: greedy generate() without any cache (the model's EOS unless ``eos_token_id`` is given)."""
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    with torch.no_grad():
        out = cold_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, **GREEDY, **kwargs)
    return out[0, len(prompt):].tolist()


def alone_logprobs(cold_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """The request alone (greedy generate() without any cache): its tokens and each one's log-probability."""
    with torch.no_grad():
        out = cold_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, output_logits=True,
                                  return_dict_in_generate=True, **GREEDY)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def config(max_new_tokens: int = 6, **kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new_tokens, **{**GREEDY, **kwargs})


def finals(manager, request_ids, timeout: float = 300.0) -> dict:
    """The final output of each of ``request_ids``."""
    outputs = {}
    for request_id in request_ids:
        while request_id not in outputs:
            output = manager.get_result(request_id=request_id, timeout=timeout)
            assert output is not None, f"no output for {request_id}"
            if output.is_finished():
                outputs[request_id] = output
    return outputs
