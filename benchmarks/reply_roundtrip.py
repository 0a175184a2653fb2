"""How often a chat template gives the model's own reply ids back: the next turn's prompt, rendered from the reply's
text and tokenized, starts with the previous prompt followed by the generated ids (then the prefix cache can hit on the
reply without the server's reply memory, :class:`~hf_hybridcache.serve.ReplyMemory`).

    PYTHONPATH=. python benchmarks/reply_roundtrip.py

Tokenizers: the package's byte tokenizer, and a byte-level BPE tokenizer trained in code (``tokenizers``, 1,024
tokens, on a few paragraphs of English) with the same special tokens and chat template. Replies: ``model`` (a seeded
random toy model of that vocabulary samples them: arbitrary id sequences, as a weak model emits) and ``canonical``
(English sentences tokenized by the tokenizer itself, as a trained model mostly emits). Printed: the share of replies
whose ids came back, as a Markdown table.
"""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_hybridcache.serve import chat_prompt_ids
from hf_hybridcache.toy import CHAT_TEMPLATE, SPECIAL_TOKENS, build_model, byte_tokenizer

WORDS = ("the shop opens at nine and closes at six on weekdays; orders ship within two days, returns are free for "
         "thirty days with the receipt, gift cards never expire and our reading group meets every second Thursday "
         "evening to talk about a novel chosen by its members. Hello! Could you tell me where my parcel is? Sure, "
         "what is the order number? It's 4521. Thanks, it left the warehouse yesterday.").split()


def bpe_tokenizer(vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(0)
    backend.train_from_iterator([" ".join(rng.choices(WORDS, k=40)) for _ in range(400)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def replies(kind: str, tokenizer, count: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    if kind == "canonical":
        return [tokenizer(" ".join(rng.choices(WORDS, k=length // 2)), add_special_tokens=False)["input_ids"][:length]
                for _ in range(count)]
    model = build_model("jamba", seed=0, vocab_size=len(tokenizer), unpadded_vocab_size=len(tokenizer))
    prompt = torch.tensor([tokenizer("<|user|>Hello there</s><|assistant|>", add_special_tokens=False)["input_ids"]])
    torch.manual_seed(2)
    with torch.no_grad():
        out = model.generate(prompt.repeat(count, 1), max_new_tokens=length, min_new_tokens=length, do_sample=True,
                             pad_token_id=0)
    return [row[prompt.shape[1]:].tolist() for row in out]


def came_back(tokenizer, reply_ids: list[int]) -> bool:
    messages = [{"role": "user", "content": "Where is my order?"}]
    before = chat_prompt_ids(tokenizer, messages)
    text = tokenizer.decode(reply_ids, skip_special_tokens=True)
    after = chat_prompt_ids(tokenizer, [*messages, {"role": "assistant", "content": text},
                                        {"role": "user", "content": "Thanks."}])
    expected = before + reply_ids
    return after[: len(expected)] == expected


def main() -> None:
    tokenizers = {"byte": byte_tokenizer(), "BPE (1,024, trained in code)": bpe_tokenizer()}
    print("| tokenizer | replies | ids given back by the template |")
    print("|---|---|---|")
    for name, tokenizer in tokenizers.items():
        for kind in ("model", "canonical"):
            sample = replies(kind, tokenizer, count=200, length=24)
            share = sum(came_back(tokenizer, r) for r in sample) / len(sample)
            print(f"| {name} | {kind} | {share:.0%} of {len(sample)} |")


if __name__ == "__main__":
    main()
