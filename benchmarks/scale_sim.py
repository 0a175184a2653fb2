"""Gateway policies over 8-64 replicas, simulated on the trace shape of ``benchmarks/scale_out.py`` (no model runs;
in the style of ``benchmarks/simulate.py``, which replays one cache's own bookkeeping).

8 clients per replica each hold a 6-turn chat over one of 4 system prompts (320 tokens; 60-token questions, 8-token
replies), all clients' turn ``t`` in flight at once (in a shuffled order), turn ``t + 1`` after all of them. A
replica keeps what the cache keeps (DESIGN.md's rules, 16-token blocks, no budget pressure): every full block it
ran, checkpoints at the prompt's last two block boundaries, at the decode end, and where a prompt left a stored path
(the divergence point); a request restores the deepest boundary at or below its length minus one whose blocks and
checkpoint are all there, locally or, with the tier, on any replica (the tier holds everything every replica
published). The gateway's policies, as SMG 1.13 describes them:

- ``round_robin``: in turn.
- ``cache_aware``: the replica whose past requests share the longest prefix with this one, when that is at least 30%
  of it; else the replica with the fewest blocks in its tree; a matched replica more than 64 requests and 1.5x over
  the mean in flight is passed over for the least loaded.
- ``prefix_hash``: a consistent-hash ring (160 points a replica) on the first 256 tokens; a replica over 1.25x the mean
  load in flight (and 10 over it) passes the request to the next on the ring.
- ``power_of_two``: the less loaded (requests in flight, as ``/v1/loads`` reports them) of two drawn at random.

Printed per policy, with and without the tier: the token hit rate, the prefill tokens the fleet computed relative to
one replica serving every client (what splitting the caches costs), and the busiest replica's computed tokens and
requests over the mean (1.00: even), which bound the throughput scaling two cores cannot show.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import defaultdict

BLOCK = 16
SYSTEM_TOKENS, QUESTION_TOKENS, REPLY_TOKENS, CLIENTS_PER_REPLICA = 320, 60, 8, 8


def trace(num_clients: int, systems: int, turns: int, seed: int = 0) -> list[list[tuple[int, list[int], list[int]]]]:
    """Rounds of ``(client, prompt ids, reply ids)``: round ``t`` holds every client's turn ``t``, shuffled."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 50000) for _ in range(SYSTEM_TOKENS)] for _ in range(systems)]
    conversations = [list(heads[c % systems]) for c in range(num_clients)]
    rounds = []
    for _ in range(turns):
        turn = []
        for c, ids in enumerate(conversations):
            ids += [rng.randrange(1, 50000) for _ in range(QUESTION_TOKENS)]
            reply = [rng.randrange(1, 50000) for _ in range(REPLY_TOKENS)]
            turn.append((c, list(ids), reply))
            ids += reply
        rng.shuffle(turn)
        rounds.append(turn)
    return rounds


def chain(ids: list[int]) -> list[int]:
    """The block hash chain: entry ``k`` certifies tokens ``[0, (k + 1) * BLOCK)``."""
    hashes, parent = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        parent = hash((parent, tuple(ids[start:start + BLOCK])))
        hashes.append(parent)
    return hashes


class Store:
    """One replica's blocks and checkpoints (a checkpoint at boundary ``(k + 1) * BLOCK`` is keyed by block k's
    hash)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.checkpoints: set[int] = set()


def hit_tokens(hashes: list[int], length: int, stores: list[Store]) -> int:
    best, k = 0, 0
    while k < len(hashes) and (k + 1) * BLOCK <= length - 1 and any(hashes[k] in s.blocks for s in stores):
        if any(hashes[k] in s.checkpoints for s in stores):
            best = (k + 1) * BLOCK
        k += 1
    return best


def serve(store: Store, prompt: list[int], reply: list[int], shared: list[Store]) -> int:
    """Serve one request on ``store`` (``shared``: what it may restore from); returns its hit."""
    hashes = chain(prompt)
    hit = hit_tokens(hashes, len(prompt), shared)
    stored = 0
    while stored < len(hashes) and hashes[stored] in store.blocks:
        stored += 1
    seen = chain(prompt + reply[:-1])  # the last sampled token never goes through the model
    store.blocks.update(seen)
    ends = {len(prompt) // BLOCK, (len(prompt) - 1) // BLOCK, (len(prompt) + len(reply) - 1) // BLOCK}
    if 0 < stored < len(hashes):
        ends.add(stored)  # the divergence point
    store.checkpoints.update(seen[k - 1] for k in ends if 0 < k <= len(seen))
    return hit


class Router:
    def __init__(self, policy: str, replicas: int, seed: int = 0) -> None:
        self.policy, self.replicas, self.rng = policy, replicas, random.Random(seed)
        self.turn = 0
        self.owners: dict[int, set[int]] = defaultdict(set)  # cache_aware's tree: block hash -> replicas
        self.tree_blocks = [0] * replicas
        points = sorted((int(hashlib.sha256(f"{r}-{v}".encode()).hexdigest()[:16], 16), r)
                        for r in range(replicas) for v in range(160))
        self.ring, self.ring_owner = [p for p, _ in points], [r for _, r in points]

    def pick(self, prompt: list[int], load: list[int]) -> int:
        mean = sum(load) / len(load)
        if self.policy == "round_robin":
            self.turn += 1
            return (self.turn - 1) % self.replicas
        if self.policy == "power_of_two":
            a, b = self.rng.sample(range(self.replicas), 2)
            return a if load[a] <= load[b] else b
        if self.policy == "prefix_hash":
            key = int(hashlib.sha256(str(prompt[:256]).encode()).hexdigest()[:16], 16)
            i = bisect.bisect(self.ring, key) % len(self.ring)
            for step in range(len(self.ring)):
                r = self.ring_owner[(i + step) % len(self.ring)]
                if not (load[r] > 1.25 * mean and load[r] - mean > 10):
                    return r
            return self.ring_owner[i]
        return self._cache_aware(prompt, load, mean)

    def _cache_aware(self, prompt: list[int], load: list[int], mean: float) -> int:
        hashes = chain(prompt)
        matching, depth = set(range(self.replicas)), 0
        for h in hashes:
            still = matching & self.owners.get(h, set())
            if not still:
                break
            matching, depth = still, depth + 1
        if depth * BLOCK >= 0.3 * len(prompt):
            chosen = min(matching, key=lambda r: (load[r], r))
            if not (load[chosen] - mean > 64 and load[chosen] > 1.5 * mean):
                return self._remember(chosen, hashes)
            return self._remember(min(range(self.replicas), key=lambda r: (load[r], r)), hashes)
        return self._remember(min(range(self.replicas), key=lambda r: (self.tree_blocks[r], load[r], r)), hashes)

    def _remember(self, replica: int, hashes: list[int]) -> int:
        for h in hashes:
            if replica not in self.owners[h]:
                self.owners[h].add(replica)
                self.tree_blocks[replica] += 1
        return replica


def simulate(policy: str, replicas: int, tier: bool, systems: int = 4, turns: int = 6, seed: int = 0) -> dict:
    stores = [Store() for _ in range(replicas)]
    router = Router(policy, replicas, seed)
    computed, requests = [0] * replicas, [0] * replicas
    prompt_total = hit_total = 0
    for turn in trace(CLIENTS_PER_REPLICA * replicas, systems, turns, seed):
        load = [0] * replicas
        for _, prompt, reply in turn:
            r = router.pick(prompt, load)
            hit = serve(stores[r], prompt, reply, stores if tier else [stores[r]])
            load[r] += 1
            requests[r] += 1
            computed[r] += len(prompt) - hit
            prompt_total, hit_total = prompt_total + len(prompt), hit_total + hit
    return {"hit_rate": hit_total / prompt_total, "computed": sum(computed),
            "work_skew": max(computed) / (sum(computed) / replicas),
            "request_skew": max(requests) / (sum(requests) / replicas)}


def print_simulation(sizes: list[int], systems: int = 4, turns: int = 6) -> None:
    print(f"\nSimulated (benchmarks/scale_sim.py): {CLIENTS_PER_REPLICA} clients per replica x {turns}-turn chats over "
          f"{systems} system prompts:\n")
    print("| replicas | policy | tier | token hit rate | prefill computed vs 1 replica | busiest replica's prefill / "
          "mean | busiest replica's requests / mean |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for replicas in sizes:
        baseline = simulate_single(replicas, systems, turns)
        print(f"| {replicas} | (1 replica, every client) | - | {baseline['hit_rate']:.3f} | 1.00 | - | - |")
        for policy in ("round_robin", "cache_aware", "prefix_hash", "power_of_two"):
            for tier in (False, True):
                r = simulate(policy, replicas, tier, systems, turns)
                print(f"| {replicas} | {policy} | {'yes' if tier else 'no'} | {r['hit_rate']:.3f} | "
                      f"{r['computed'] / baseline['computed']:.2f} | {r['work_skew']:.2f} | {r['request_skew']:.2f} |")


def simulate_single(replicas: int, systems: int, turns: int) -> dict:
    """One replica serving the clients of ``replicas`` (the reference hit rate and computed tokens)."""
    store, prompt_total, hit_total, computed = Store(), 0, 0, 0
    for turn in trace(CLIENTS_PER_REPLICA * replicas, systems, turns):
        for _, prompt, reply in turn:
            hit = serve(store, prompt, reply, [store])
            prompt_total, hit_total = prompt_total + len(prompt), hit_total + hit
            computed += len(prompt) - hit
    return {"hit_rate": hit_total / prompt_total, "computed": computed}
