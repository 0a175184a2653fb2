"""What a gateway or an orchestrator reads of a worker: probes, the model's identity and the engine's load.

The routes follow what SGLang's workers serve, since gateways read them (SMG, the Shepherd Model Gateway, 1.13:
``model_gateway/src/workflow/steps/local/{detect_backend,discover_metadata}.rs`` and
``model_gateway/src/worker/monitor.rs``; its own mock worker, ``crates/mock_worker/src/http.rs``):

- ``GET /health``: what gateways probe before routing to a worker (SMG's ``--health-check-endpoint`` default, SGLang's
  and vLLM's name): 200 ``{"status": "ok"}`` when it takes requests, 503 with the reason while it drains or once the
  engine's loop died.
- ``GET /readiness``: the same answer, named for a readiness probe. ``GET /liveness``: 200 while the process serves
  (draining included), 503 only once the engine's loop died (restart me).
- ``GET /server_info`` and ``GET /model_info``: the model and the limits. SMG asks these first when it registers a
  worker (a 404 makes it fall back to ``/get_server_info`` and ``/get_model_info`` and log that it did), and a
  worker that serves ``/server_info`` but not vLLM's ``/version`` is registered as an SGLang-like engine instead of a
  ``generic`` one with a warning.
- ``GET /v1/loads``: the load, in the schema SMG polls for its load-aware policies (``power_of_two``,
  ``least_load``, ``cache_aware``'s balancing, overload protection): requests running and waiting, KV usage, the
  tokens still to run for the requests it holds and the prefix hit rate
  (``WorkerLoadResponse`` in SMG's ``crates/protocols/src/worker.rs``).
- ``POST /flush_cache``: empties the stored cache, as SGLang's (SMG's ``POST /flush_cache`` calls it on every worker).

The loading and draining phases themselves live in :mod:`~hf_hybridcache.serve.lifecycle`, which shares its
:class:`~hf_hybridcache.serve.lifecycle.Phase` with these routes through ``app.state.lifecycle``.
"""

from __future__ import annotations

import asyncio
import datetime

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from .._version import __version__
from ..models.deterministic import serves_deterministic
from .lifecycle import Phase


def add_worker_routes(app: FastAPI, backend, model_id: str, cache, tokenizer=None) -> None:
    """Add the probe, info and load routes to ``app`` and give it ``app.state.lifecycle`` (a :class:`Phase`,
    ready unless a :mod:`~hf_hybridcache.serve.lifecycle` runner says otherwise).

    Args:
        backend: an :class:`~hf_hybridcache.serve.backends.EngineBackend` or
            :class:`~hf_hybridcache.serve.backends.SequentialBackend`.
        model_id: the served model name.
        cache: the :class:`~hf_hybridcache.HybridPrefixCache` behind the engine, or None.
        tokenizer: the served tokenizer (its ``name_or_path`` is reported).
    """
    phase = app.state.lifecycle = Phase()

    def not_ready() -> str | None:
        if phase.name != "ready":
            return phase.name
        return None if backend.healthy else "the engine's loop died"

    @app.get("/health")
    async def health():
        reason = not_ready()
        if reason is None:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy" if phase.name == "ready" else phase.name, "reason": reason},
                            status_code=503)

    @app.get("/readiness")
    async def readiness():
        reason = not_ready()
        if reason is None:
            return {"status": "ready"}
        return JSONResponse({"status": "not_ready", "reason": reason}, status_code=503)

    @app.get("/liveness")
    async def liveness():
        if phase.name == "ready" and not backend.healthy:
            return JSONResponse({"status": "dead", "reason": "the engine's loop died"}, status_code=503)
        return {"status": "alive", "phase": phase.name}

    @app.get("/server_info")
    async def server_info():
        return server_fields(backend, model_id, cache, tokenizer)

    @app.get("/model_info")
    async def model_info():
        return model_fields(backend, model_id, tokenizer)

    @app.get("/v1/loads")
    async def loads():
        return load_report(backend, cache)

    @app.post("/flush_cache")
    async def flush_cache():
        """SGLang's route, which SMG's ``POST /flush_cache`` calls on every worker: empty the stored cache (the
        shared tier keeps its entries). Waits for the engine's step in progress."""
        if cache is not None:
            await asyncio.to_thread(cache.clear)
        return {"status": "ok", "flushed": cache is not None}


def _model(backend, cache):
    return cache.model if cache is not None else backend.model


def server_fields(backend, model_id: str, cache, tokenizer) -> dict:
    """SGLang's ``/server_info`` fields a gateway reads (``ServerInfo`` in SMG's ``discover_metadata.rs``), and what
    this worker adds: the engine's name, whether it has a shared tier, its speculation (the drafter's class and
    the draft tokens per step at most, None and 0 without) and whether its cache runs deterministic mode."""
    model = _model(backend, cache)
    manager = getattr(backend, "manager", None)
    limits = None if manager is None else manager.limits
    block_size = None if cache is None else cache.block_size
    return {
        "model_path": model.name_or_path or model_id,
        "served_model_name": model_id,
        "tokenizer_path": getattr(tokenizer, "name_or_path", None) or None,
        "version": __version__,
        "engine": "hf_hybridcache",
        "is_embedding": False,
        "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "context_length": backend.max_request_tokens,
        "max_running_requests": 1 if limits is None else limits.max_running_requests,
        "max_total_tokens": None if limits is None else limits.max_running_pages * block_size,
        "page_size": block_size,
        "prefix_cache": cache is not None,
        "remote_tier": cache is not None and cache.remote is not None,
        "speculative_drafter": _drafter_name(manager),
        "speculative_num_draft_tokens": backend.num_speculative_tokens,
        "deterministic": cache is not None and serves_deterministic(cache.model),
    }


def _drafter_name(manager) -> str | None:
    speculation = None if manager is None else manager.speculation
    return None if speculation is None else type(speculation.drafter).__name__


def model_fields(backend, model_id: str, tokenizer) -> dict:
    """SGLang's ``/model_info`` (``ModelInfo`` in SMG's ``discover_metadata.rs``)."""
    model = _model(backend, getattr(backend, "cache", None))
    config = model.config
    return {
        "model_path": model.name_or_path or model_id,
        "tokenizer_path": getattr(tokenizer, "name_or_path", None) or None,
        "is_generation": True,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.model_type,
        "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
    }


def load_report(backend, cache) -> dict:
    """``/v1/loads``: one rank (``dp_rank_count`` 1). ``token_usage`` is the share of the engine's running memory in
    use: of its KV pages (pages a hit shares with the store are the store's, not counted) or of its state slots (one
    per running request: a hybrid's recurrent layers), whichever is fuller, since either one full makes new requests
    wait (SMG's overload protection and KV-pressure term read it); ``num_waiting_uncached_tokens`` is
    :func:`work_ahead` (hits of waiting requests are looked up at admission, so it counts their whole prompts);
    ``cache_hit_rate`` is the prefix cache's token hit rate so far. ``gen_throughput`` is 0, which SMG reads as "not
    reported" and replaces by ``--least-load-default-throughput`` for every replica alike: its expected-wait score
    divides the work ahead, and 1,024 tokens for each request it sent since its last poll, by this rate, so a
    realized rate (tokens generated per second) made a lightly used replica look slow and a busy one fast, and sent
    the busy one more (measured: 41 / 37 / 21 requests with replica 0 the busy one)."""
    running, waiting = backend.load()
    engine = getattr(getattr(backend, "manager", None), "batch_processor", None)
    snapshot = {
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
        "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "max_total_num_tokens": 0, "token_usage": 0.0,
        "gen_throughput": 0.0,  # not reported: see below
        "cache_hit_rate": 0.0 if cache is None else round(cache.stats.token_hit_rate, 4),
        "utilization": 0.0, "max_running_requests": 1,
    }
    if engine is not None:
        limits, block_size = engine.limits, engine.block_size
        used_pages = sum(len(r.own_pages) for r in list(engine.scheduler.running))
        capacity = limits.max_running_pages * block_size
        snapshot.update(
            num_waiting_uncached_tokens=work_ahead(engine),
            num_used_tokens=used_pages * block_size, max_total_num_tokens=capacity,
            token_usage=max(used_pages / limits.max_running_pages, running / limits.max_running_requests),
            utilization=running / limits.max_running_requests,
            max_running_requests=limits.max_running_requests,
        )
    else:
        snapshot["utilization"] = float(running)
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
    return {"timestamp": stamp, "dp_rank_count": 1, "loads": [snapshot]}


def work_ahead(engine) -> int:
    """Tokens the engine still has to run for the requests it holds: the prompt tokens not yet prefilled and the
    tokens each may still generate, running or waiting. The engine admits while it has slots, so this, not a queue,
    is what a new request waits behind; over ``gen_throughput`` it is SMG's expected wait."""
    ahead = 0
    for request in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        ahead += max(len(request.prompt) - request.past, 0) + max(request.max_new_tokens - len(request.generated), 0)
    return ahead
