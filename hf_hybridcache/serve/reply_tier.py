"""Reply token ids shared by the replicas of a deployment through the shared tier.

A chat's next turn carries the previous reply as text, and a server splices in the ids it generated
(:mod:`~hf_hybridcache.serve.prompts`) so the prompt is the one the model saw and the prefix cache hits on it. Behind a
gateway the next turn may reach another replica, which never generated that reply: re-encoding the text gives other
ids whenever the reply held invalid UTF-8, special tokens or merges across its edges, so the prompt differs from one
replica's, the reply may differ, and the cache misses from there. With a tier, each replica therefore also publishes
the ids of its replies there (``SET NX``, before the reply's last piece is sent, so the client's next turn finds them
wherever it goes) and looks up those it does not hold (one ``GET``; both through the tier's breaker: a tier that does
not answer means re-encoding, as without one).

Keys live in the tier's namespace (versions, secret) under the root of the request's chains (hash seed, model
identity, weights state, tenant salt), so another model, tenant or secret never reads them. Under a secret a value
carries an HMAC-SHA256 of the key and the ids, and a value without a valid one is ignored.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array

from .prompts import ReplyMemory

_MAC_BYTES = 32


def reply_memory(cache) -> ReplyMemory:
    """A :class:`SharedReplyMemory` when ``cache`` has a tier, else a plain :class:`ReplyMemory` (one process)."""
    if cache is None or cache.remote is None:
        return ReplyMemory()
    return SharedReplyMemory(cache)


class SharedReplyMemory(ReplyMemory):
    """A :class:`ReplyMemory` whose replies are also published to, and looked up in, ``cache``'s tier."""

    def __init__(self, cache, max_replies: int = 65536) -> None:
        super().__init__(max_replies)
        self.cache, self.tier = cache, cache.remote
        self._secret = cache.remote.config.secret

    def remember(self, salt: str | None, prompt_ids: list[int], text: str, token_ids: list[int],
                 images: bytes = b"") -> None:
        super().remember(salt, prompt_ids, text, token_ids, images)
        key = self._key(salt, prompt_ids, text, images)
        payload = array("q", token_ids).tobytes()
        # Written before the reply's last piece is sent (not queued): the client's next turn, which may reach
        # another replica at once, finds it. One round trip, skipped while the tier's breaker is open.
        self.tier.client.write([(key, self._mac(key, payload) + payload)])

    def lookup(self, salt: str | None, prompt_ids: list[int], text: str, images: bytes = b"") -> list[int] | None:
        ids = super().lookup(salt, prompt_ids, text, images)
        if ids is not None:
            return ids
        key = self._key(salt, prompt_ids, text, images)
        values = self.tier.client.get([key])
        if not values or values[0] is None:
            return None
        value = values[0]
        mac, payload = value[:_MAC_BYTES], value[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(key, payload)) or len(payload) % 8:
            return None
        ids = array("q", payload).tolist()
        super().remember(salt, prompt_ids, text, ids, images)
        return ids

    def _key(self, salt: str | None, prompt_ids: list[int], text: str, images: bytes) -> str:
        digest = hashlib.sha256(bytes(self.cache.core.root(salt)))
        digest.update(array("q", prompt_ids).tobytes())
        digest.update(text.encode("utf-8", "surrogatepass"))
        if images:  # the prompt's images (a text prompt's key is as it was)
            digest.update(b"|images|" + images)
        return f"{self.tier.codec.namespace}:reply:{digest.hexdigest()}"

    def _mac(self, key: str, payload: bytes) -> bytes:
        """An HMAC under the secret; without one a SHA-256, which catches damage but not forgery (as the entries')."""
        if self._secret is None:
            return hashlib.sha256(key.encode() + payload).digest()
        return hmac.new(self._secret, key.encode() + payload, hashlib.sha256).digest()
