"""Turn the configured tiers into running engines: fetch registry models if needed, load, start."""

from __future__ import annotations

import logging
import time

from engines.async_engine import AsyncEngine
from engines.engine import Engine, EngineConfig
from engines.fetch import FetchError, fetch_model, is_fetched
from engines.quantized_checkpoint import is_quantized_dir
from gateway.settings import Settings, TierSettings

log = logging.getLogger(__name__)


def ensure_models(settings: Settings, *, progress: bool = True) -> None:
    """Fetch every registry model a tier names that is not on disk yet (or fail saying how to)."""
    for name, tier in settings.tiers.items():
        if not tier.is_registry_model:
            continue
        quantized = tier.weights != "bf16"
        if quantized and is_quantized_dir(settings.model_dir(tier)):
            continue
        if not quantized and is_fetched(settings.home_dir, tier.model):
            continue
        if not settings.auto_fetch:
            raise FetchError(f"tier {name!r} needs {tier.model}; run `switchboard models fetch {tier.model}`")
        if quantized:
            from engines.quantized_checkpoint import fetch_quantized

            fetch_quantized(tier.model, settings.home_dir, tier.weights, progress=progress)
        else:
            fetch_model(tier.model, settings.home_dir, progress=progress)


def load_engines(settings: Settings) -> dict[str, AsyncEngine]:
    """One engine per distinct (model, dtype, engine config); tiers naming the same model share it."""
    ensure_models(settings)
    loaded: dict[tuple, AsyncEngine] = {}
    engines: dict[str, AsyncEngine] = {}
    for name, tier in settings.tiers.items():
        key = (str(settings.model_dir(tier)), tier.dtype, tier.weights, engine_config(tier))
        if key not in loaded:
            loaded[key] = AsyncEngine(
                _load(settings, name, tier), name=name, threads=tier.threads or settings.max_threads
            )
        engines[name] = loaded[key]
    return engines


def engine_config(tier: TierSettings) -> EngineConfig:
    return EngineConfig(
        block_size=tier.block_size,
        kv_cache_bytes=int(tier.kv_cache_bytes),
        max_num_seqs=tier.max_num_seqs,
        max_num_batched_tokens=tier.max_num_batched_tokens,
        enable_prefix_caching=tier.enable_prefix_caching,
        max_model_len=tier.max_model_len,
        kv_cache_dtype=tier.kv_cache_dtype,
    )


def _load(settings: Settings, name: str, tier: TierSettings) -> Engine:
    started = time.perf_counter()
    # A registry tier's quantized checkpoint is served as stored; a directory is quantized on load.
    weights = None if tier.is_registry_model else tier.weights
    engine = Engine.from_dir(
        settings.model_dir(tier), dtype=tier.dtype, config=engine_config(tier), name=tier.model, weights=weights
    )
    log.info(
        "tier %s: loaded %s (%s, %s weights) in %.1f s",
        name,
        tier.model,
        tier.dtype,
        engine.model.weights_format,
        time.perf_counter() - started,
    )
    return engine
