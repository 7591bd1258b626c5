"""Turn the configured tiers into running engines: fetch registry models if needed, load, start."""

from __future__ import annotations

import logging
import time

from engines.async_engine import AsyncEngine
from engines.engine import Engine, EngineConfig
from engines.fetch import FetchError, fetch_model, is_fetched
from engines.kv_budget import KVBudget
from engines.kv_tier import KVTier, checkpoint_fingerprint
from engines.model_loader import load_model
from engines.quantized_checkpoint import is_quantized_dir
from engines.speculator import SpeculativeConfig
from engines.tokenizer import Tokenizer
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
    """One engine per distinct tier configuration; tiers naming the same one share it. Tiers without
    a pool of their own draw KV blocks from one budget (`kv_pool_bytes`); a tier speculating with a
    draft tier uses that tier's loaded model, so its weights are in memory once."""
    ensure_models(settings)
    shared = [t for t in settings.tiers.values() if t.kv_cache_bytes is None]
    budget = KVBudget(int(settings.kv_pool_bytes)) if shared else None
    loaded: dict[tuple, AsyncEngine] = {}
    engines: dict[str, AsyncEngine] = {}
    # Draft tiers first: the tiers they draft for need their models.
    order = sorted(settings.tiers, key=lambda n: settings.tiers[n].speculative == "draft")
    for name in order:
        tier = settings.tiers[name]
        draft = engines[tier.draft_tier].engine if tier.speculative == "draft" and tier.draft_tier else None
        kv_tier = (tier.kv_tier, tier.kv_tier_min_blocks)
        key = (str(settings.model_dir(tier)), tier.dtype, tier.weights, engine_config(tier), tier.draft_tier, kv_tier)
        if key not in loaded:
            engine = _load(settings, name, tier, draft, budget if tier.kv_cache_bytes is None else None)
            loaded[key] = AsyncEngine(engine, name=name, threads=tier.threads or settings.max_threads)
        engines[name] = loaded[key]
    return {name: engines[name] for name in settings.tiers}


def engine_config(tier: TierSettings) -> EngineConfig:
    spec = SpeculativeConfig(
        method=tier.speculative, num_speculative_tokens=tier.num_speculative_tokens, draft_vocab=tier.draft_vocab
    )
    return EngineConfig(
        block_size=tier.block_size,
        kv_cache_bytes=int(tier.kv_cache_bytes) if tier.kv_cache_bytes is not None else 1 << 30,
        max_num_seqs=tier.max_num_seqs,
        max_num_batched_tokens=tier.max_num_batched_tokens,
        enable_prefix_caching=tier.enable_prefix_caching,
        max_model_len=tier.max_model_len,
        kv_cache_dtype=tier.kv_cache_dtype,
        speculative=spec,
    )


def _load(settings: Settings, name: str, tier: TierSettings, draft: Engine | None, budget: KVBudget | None) -> Engine:
    started = time.perf_counter()
    # A registry tier's quantized checkpoint is served as stored; a directory is quantized on load.
    weights = None if tier.is_registry_model else tier.weights
    model_dir = settings.model_dir(tier)
    tokenizer = Tokenizer(model_dir)
    if draft is not None and draft.tokenizer.hf.get_vocab() != tokenizer.hf.get_vocab():
        raise ValueError(f"tier {name!r}: draft tier {tier.draft_tier!r} has another tokenizer; it cannot draft")
    kv_tier = None
    if tier.kv_tier and settings.redis_url:
        kv_tier = KVTier(
            settings.redis_url,
            settings.redis_namespace,
            checkpoint=checkpoint_fingerprint(model_dir, weights),
            min_blocks=tier.kv_tier_min_blocks,
        )
    elif tier.kv_tier:
        log.warning("tier %s: kv_tier needs redis_url; serving without it", name)
    engine = Engine(
        load_model(model_dir, tier.dtype, weights),
        tokenizer,
        engine_config(tier),
        name=tier.model,
        draft_model=None if draft is None else draft.model,
        kv_budget=budget,
        kv_tier=kv_tier,
    )
    log.info(
        "tier %s: loaded %s (%s, %s weights%s) in %.1f s",
        name,
        tier.model,
        tier.dtype,
        engine.model.weights_format,
        f", drafted by {tier.draft_tier}" if draft is not None else "",
        time.perf_counter() - started,
    )
    return engine
