"""How calls from several threads share one store.

A cache, every view made by ``with_salt`` and a serving engine on the cache share one core: one store. Three locks, each
held only as long as it must be:

- The **store lock** (``core.store_lock``, re-entrant) is held for each operation on the store and the counters
  (lookup + restore copy + pin of a hit, storing a forward's blocks and checkpoints, eviction, releasing a chain):
  short, so ``generate()`` calls on different views and a serving engine's steps interleave instead of waiting for
  each other's whole call.
- A view's **call lock** (``view.live.call_lock``, re-entrant) is held for a whole ``generate()`` call and for every
  forward with the view: one view serves one call at a time, since its live layers are the call's state. Calls from
  several threads on *one* view run one at a time; on different views (``cache.with_salt(...)`` per call or per
  thread) they run at the same time, each with its own live state, and see a consistent store.
- The **call gate** (``core.calls``) lets ``clear()``, ``save()`` and budget changes wait until no ``generate()`` call
  or forward runs on any view (and holds new ones back meanwhile); calls only pass through it.

All three are released in ``finally`` blocks, so a ``KeyboardInterrupt`` or ``SystemExit`` inside a call leaves
nothing held. From inside a running ``generate()`` (a streamer or stopping criterion, same thread) the operations
that would change the store under it, and a second ``generate()`` with the cache or any of its views, raise
``RuntimeError`` at once instead of deadlocking or corrupting the call.

A serving engine's loop passes the gate once per step, in its own thread (:meth:`CallScopes.engine_scope`), and
calls back code of the user's in that thread while it is inside: logits processors, grammar matchers, forward hooks,
the vision tower. From there ``clear()``, ``save()`` and budget changes, which wait for the step to end, would wait
forever, and a ``generate()`` with the cache would run a whole call inside one step of every running request: each
raises ``RuntimeError`` at once, saying to call it from another thread (where it runs between two steps) or to add
the request to the engine. Nothing is deferred to the step's end: ``clear()`` returning before the store is empty,
or ``save()`` and a budget change whose errors (a bad path, a budget below what is pinned) reach nobody, would
break what their callers read next. ``reset()`` and ``restore()`` (a view's own live state) and ``load()`` (a new
cache) wait for nothing the step holds and run.

A request stays live on its view after ``generate()`` returns (a direct forward may continue it, its chain stays
pinned); when a request begins on any view, the live requests of views that are not in a call end (their chains are
unpinned), so views made per call pin nothing for long.
"""

from __future__ import annotations

import contextlib
import threading


class CallScopes:
    """The scopes of calls on a :class:`~hf_hybridcache.core.sharing.CacheCore` (its base class): it sets
    ``store_lock``, ``calls`` (a :class:`CallGate`), ``generating_threads`` and ``engine_threads``."""

    store_lock: threading.RLock
    calls: CallGate
    generating_threads: set[int]
    engine_threads: set[int]

    @contextlib.contextmanager
    def generate_scope(self, view):
        """Hold ``view``'s call lock and pass the call gate for one ``generate()`` call.

        Raises:
            RuntimeError: this thread is already inside a ``generate()`` call with this cache or one of its views.
        """
        me = threading.get_ident()
        if me in self.generating_threads:
            raise RuntimeError(
                "This HybridPrefixCache is already running a generate() call in this thread (a streamer, logits "
                "processor or stopping criterion calling generate() again?); call generate() again after the running "
                "call returns, or use another HybridPrefixCache."
            )
        if me in self.engine_threads:
            raise RuntimeError(
                "generate() with this HybridPrefixCache cannot run inside a step of its continuous-batching engine "
                "(from a logits processor, grammar, forward hook or other code the engine calls in its thread): it "
                "would hold every running request for the whole call. Add the request to the engine instead "
                "(manager.add_request), or call generate() from another thread."
            )
        with self.call_scope(view):
            self.generating_threads.add(me)
            try:
                yield
            finally:
                self.generating_threads.discard(me)

    @contextlib.contextmanager
    def call_scope(self, view):
        """Hold ``view``'s call lock and pass the call gate for one forward (re-entrant inside this thread's own
        ``generate()``)."""
        with view.live.call_lock, self.calls.call():
            yield

    @contextlib.contextmanager
    def engine_scope(self):
        """Pass the call gate for one step of a serving engine (or one turn of its loop), marking this thread as
        inside it, so the operations that wait for the step refuse to run from it (re-entrant: a step inside the
        loop's turn)."""
        me = threading.get_ident()
        outer = me not in self.engine_threads
        with self.calls.call():
            self.engine_threads.add(me)
            try:
                yield
            finally:
                if outer:
                    self.engine_threads.discard(me)

    @contextlib.contextmanager
    def view_idle(self, view, operation: str):
        """Hold ``view``'s call lock for an operation on its live state (waits for its call in another thread).

        Raises:
            RuntimeError: called from inside a running ``generate()`` call in this thread.
        """
        self._refuse_inside_generate(operation)
        with view.live.call_lock:
            yield

    @contextlib.contextmanager
    def idle(self, operation: str):
        """Wait until no call runs on any view (and hold new ones back), then hold ``store_lock``: for an operation
        on the whole store.

        Raises:
            RuntimeError: called from inside a running ``generate()`` call or an engine step in this thread.
        """
        self._refuse_inside_generate(operation)
        if threading.get_ident() in self.engine_threads:
            raise RuntimeError(
                f"{operation} cannot run inside a step of the continuous-batching engine serving this "
                "HybridPrefixCache (from a logits processor, grammar, forward hook or other code the engine calls in "
                "its thread): it waits for the step to end, which cannot end while it waits. Call it from another "
                "thread (threading.Thread(target=...).start() returns at once; it runs between two steps), or once "
                "the outputs you wait for have arrived."
            )
        with self.calls.exclusive(), self.store_lock:
            yield

    def _refuse_inside_generate(self, operation: str) -> None:
        if threading.get_ident() in self.generating_threads:
            raise RuntimeError(
                f"{operation} cannot run while generate() is running with this HybridPrefixCache in the same thread "
                "(from a streamer or a stopping criterion?); call it after generate() returns."
            )


class CallGate:
    """Calls pass through the gate together; an exclusive holder waits until none is inside and keeps new ones out
    until it is done (new calls wait while it waits, so it is not starved). Calls that waited through an exclusive
    holder pass before the next one begins (so back-to-back ``clear()`` calls do not starve the engine's steps). A
    thread already inside passes again without waiting (a forward inside its own ``generate()``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside: dict[int, int] = {}
        self._exclusive = False
        self._waiting = 0
        self._tickets = 0  # calls that ever waited at the gate, numbered in arrival order
        self._blocked: set[int] = set()  # the tickets of calls waiting now
        self._admit_upto = 0  # calls with a ticket up to this pass even while an exclusive holder waits

    @contextlib.contextmanager
    def call(self):
        me = threading.get_ident()
        with self._cond:
            if me not in self._inside:
                self._tickets += 1
                ticket = self._tickets
                self._blocked.add(ticket)
                try:
                    self._cond.wait_for(
                        lambda: not self._exclusive and (not self._waiting or ticket <= self._admit_upto)
                    )
                finally:
                    self._blocked.discard(ticket)
            self._inside[me] = self._inside.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._inside[me] -= 1
                if not self._inside[me]:
                    del self._inside[me]
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._exclusive and not self._inside and not any(
                    ticket <= self._admit_upto for ticket in self._blocked))
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._admit_upto = self._tickets  # the calls that waited through this holder go before the next
                self._cond.notify_all()
