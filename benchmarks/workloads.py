"""Seeded request workloads as ``datasets.Dataset``s, for the hit-rate and TTFT benchmarks.

Every row is one request (one ``generate()`` call) in arrival order:

- ``request_id`` (int): position in the trace;
- ``session`` (str): the conversation / agent / user the request belongs to;
- ``messages`` (list of ``{"role", "content"}``): the chat so far; the prompt is this rendered by the chat template
  with the generation prompt appended;
- ``reply`` (str): the assistant's answer, which a later request of the same session may carry in its history.

The text is written by the generators from small word lists (about one token per character with the byte-level
tokenizer of :mod:`hf_hybridcache.toy`). Shapes of the four workloads:

- (a) ``system_prompt_questions``: one long system prompt, many different one-turn questions;
- (b) ``multi_turn_chats``: chats whose turn k is turn k-1's messages + its reply + a new user message, interleaved;
- (c) ``few_shot``: an instruction, then examples drawn from a shared pool in different orders (popular examples tend
  to come first), then the query;
- (d) ``agent_tree``: agents that share a long trunk (system prompt + tool descriptions); each task branches off the
  trunk, each step continues a branch with the last tool call's observation, and some steps fork into several
  observations (retries, parallel tool calls): branches of branches. Steps of many agents interleave.

``load_jsonl_chats(path)`` turns a local JSONL file of chats (``{"messages": [...]}`` per line, OpenAI style) into the
same schema through ``datasets.load_dataset("json", ...)``: one request per assistant message.
"""

from __future__ import annotations

import random

import datasets

_WORDS = (
    "the a an of to in for on with by from as at this that these those it its is are was were be been has have had "
    "not no can could will would should may might must do does did done make made use used get got set put run ran "
    "file files data table row column value key index query result error status request response user account order "
    "item price total date time day week month year team project task plan step tool call input output report "
    "summary list search update create delete read write check test build deploy server client service api model "
    "cache memory token prompt answer question reason because however then when while before after first next last "
    "small large long short new old fast slow high low good bad clear simple quick careful exact correct"
).split()


def _sentence(rng: random.Random, min_words: int = 6, max_words: int = 16) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
    return " ".join(words).capitalize() + "."


def _text(rng: random.Random, num_chars: int) -> str:
    """Sentences until about ``num_chars`` characters."""
    parts: list[str] = []
    while sum(len(p) + 1 for p in parts) < num_chars:
        parts.append(_sentence(rng))
    return " ".join(parts)


def _rows_to_dataset(rows: list[dict]) -> datasets.Dataset:
    for i, row in enumerate(rows):
        row["request_id"] = i
    return datasets.Dataset.from_list(rows)


def system_prompt_questions(
    num_requests: int = 200, system_chars: int = 2000, seed: int = 0
) -> datasets.Dataset:
    """(a) One shared system prompt of about ``system_chars`` characters and ``num_requests`` different questions."""
    rng = random.Random(seed)
    system = "You are the assistant of a help desk. Policies follow. " + _text(rng, system_chars)
    rows = []
    for i in range(num_requests):
        question = _text(rng, rng.randint(40, 240))
        rows.append({
            "session": f"user-{i}",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "reply": _text(rng, rng.randint(40, 160)),
        })
    return _rows_to_dataset(rows)


def multi_turn_chats(
    num_chats: int = 40, turns: int = 6, system_chars: int = 400, seed: int = 0
) -> datasets.Dataset:
    """(b) ``num_chats`` chats of ``turns`` turns each, sharing a short system prompt; the turns of different chats
    interleave at random (each chat's turns stay in order)."""
    rng = random.Random(seed)
    system = "You are a friendly assistant. " + _text(rng, system_chars)
    pending = {c: 0 for c in range(num_chats)}
    history = {c: [{"role": "system", "content": system}] for c in range(num_chats)}
    rows = []
    while pending:
        chat = rng.choice(sorted(pending))
        messages = history[chat] + [{"role": "user", "content": _text(rng, rng.randint(30, 200))}]
        reply = _text(rng, rng.randint(40, 300))
        rows.append({"session": f"chat-{chat}", "messages": messages, "reply": reply})
        history[chat] = messages + [{"role": "assistant", "content": reply}]
        pending[chat] += 1
        if pending[chat] == turns:
            del pending[chat]
    return _rows_to_dataset(rows)


def few_shot(
    num_requests: int = 200, pool_size: int = 16, shots: int = 5, seed: int = 0
) -> datasets.Dataset:
    """(c) An instruction, ``shots`` examples drawn without replacement from a pool of ``pool_size`` (weights
    1/rank, so popular examples often lead and orders share prefixes of different lengths), then the query."""
    rng = random.Random(seed)
    instruction = "Classify the sentiment of the last review. Examples follow. " + _text(rng, 300)
    pool = [f"Review: {_text(rng, rng.randint(120, 320))}\nLabel: {rng.choice(['positive', 'negative'])}\n"
            for _ in range(pool_size)]
    weights = [1.0 / (rank + 1) for rank in range(pool_size)]
    rows = []
    for i in range(num_requests):
        left = list(range(pool_size))
        chosen = []
        for _ in range(shots):
            pick = rng.choices(left, weights=[weights[j] for j in left])[0]
            left.remove(pick)
            chosen.append(pick)
        prompt = instruction + "\n" + "".join(pool[j] for j in chosen) + f"Review: {_text(rng, 100)}\nLabel:"
        rows.append({"session": f"user-{i}", "messages": [{"role": "user", "content": prompt}],
                     "reply": rng.choice([" positive", " negative"])})
    return _rows_to_dataset(rows)


def agent_tree(
    num_tasks: int = 48,
    max_steps: int = 4,
    trunk_chars: int = 6000,
    fork_probability: float = 0.3,
    max_forks: int = 3,
    seed: int = 0,
) -> datasets.Dataset:
    """(d) Agents sharing a trunk of about ``trunk_chars`` characters (system prompt and tool descriptions).

    Each of ``num_tasks`` tasks branches off the trunk. A step's prompt is its branch's history; its reply is a tool
    call, and the next step appends the tool's observation. With ``fork_probability`` a step has 2 to ``max_forks``
    next steps with different observations (retries, parallel calls); branches end after ``max_steps`` steps. Ready
    steps of all agents are served in random order.
    """
    rng = random.Random(seed)
    tools = "\n".join(f"Tool {name}: {_text(rng, 200)}" for name in ("search", "read_file", "run_tests", "edit",
                                                                    "browse", "sql", "calendar", "email"))
    trunk = "You are an autonomous agent. Think, then call one tool per step. " + _text(rng, trunk_chars - 1600)
    system = trunk + "\n" + tools
    ready = [(f"task-{t}", [{"role": "system", "content": system},
                            {"role": "user", "content": "Task: " + _text(rng, rng.randint(80, 400))}], 1)
             for t in range(num_tasks)]
    rows = []
    while ready:
        session, messages, step = ready.pop(rng.randrange(len(ready)))
        reply = f"Call {rng.choice(['search', 'read_file', 'run_tests', 'edit', 'sql'])}: {_text(rng, rng.randint(30, 160))}"
        rows.append({"session": session, "messages": messages, "reply": reply})
        if step == max_steps:
            continue
        forks = rng.randint(2, max_forks) if rng.random() < fork_probability else 1
        for f in range(forks):
            observation = "Observation: " + _text(rng, rng.randint(60, 500))
            ready.append((f"{session}.{f}" if forks > 1 else session,
                          messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}],
                          step + 1))
    return _rows_to_dataset(rows)


def load_jsonl_chats(path: str) -> datasets.Dataset:
    """A local JSONL file of chats (one ``{"messages": [{"role", "content"}, ...]}`` per line) as requests: one per
    assistant message, whose prompt is the messages before it, chats in file order.

    Raises:
        ValueError: no line has an assistant message after another message (nothing to replay).
    """
    chats = datasets.load_dataset("json", data_files=path, split="train")
    rows = []
    for c, chat in enumerate(chats):
        messages = chat["messages"]
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and i > 0:
                rows.append({"session": f"chat-{c}", "messages": messages[:i], "reply": message["content"]})
    if not rows:
        raise ValueError(
            f"{path!r} holds no assistant message after another message, so it gives no request to replay; each line "
            'needs {"messages": [..., {"role": "user", ...}, {"role": "assistant", ...}]}.'
        )
    return _rows_to_dataset(rows)


WORKLOADS = {
    "a_system_prompt": system_prompt_questions,
    "b_multi_turn": multi_turn_chats,
    "c_few_shot": few_shot,
    "d_agent_tree": agent_tree,
}
