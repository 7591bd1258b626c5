"""Turn the configured tiers into running engines: fetch registry models if needed, load, start."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from core.settings import Settings, TierSettings
from engines.async_engine import AsyncEngine
from engines.checkpoints.fetch import FetchError, fetch_model, is_fetched
from engines.checkpoints.loader import load_model
from engines.checkpoints.quantized import is_quantized_dir
from engines.engine import Engine, EngineConfig
from engines.kv.budget import KVBudget
from engines.kv.tier import KVTier, checkpoint_fingerprint
from engines.protocol import TierEngine
from engines.remote.engine import RemoteConfig, RemoteEngine
from engines.speculative.speculator import SpeculativeConfig
from engines.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def ensure_models(settings: Settings, *, progress: bool = True) -> None:
    """Fetch every registry model a tier names that is not on disk yet (or fail saying how to); convert
    every GGUF file a tier names by path, once."""
    for name, tier in settings.tiers.items():
        if tier.is_gguf:
            from engines.checkpoints.gguf_convert import ensure_gguf_dir

            ensure_gguf_dir(Path(tier.model), settings.home_dir, progress=progress)
            continue
        if not tier.is_registry_model:
            continue
        # A remote tier needs only the tokenizer, which comes with the whole (bf16) registry model.
        quantized = tier.weights != "bf16" and not tier.is_remote
        if quantized and is_quantized_dir(settings.model_dir(tier)):
            continue
        if not quantized and is_fetched(settings.home_dir, tier.model):
            continue
        if not settings.auto_fetch:
            raise FetchError(f"tier {name!r} needs {tier.model}; run `switchboard models fetch {tier.model}`")
        if quantized:
            from engines.checkpoints.quantized import fetch_quantized

            fetch_quantized(tier.model, settings.home_dir, tier.weights, progress=progress)
        else:
            fetch_model(tier.model, settings.home_dir, progress=progress)


def load_engines(settings: Settings) -> dict[str, TierEngine]:
    """One engine per distinct tier configuration; tiers naming the same one share it. Tiers without
    a pool of their own draw KV blocks from one budget (`kv_pool_bytes`); a tier speculating with a
    draft tier uses that tier's loaded model, so its weights are in memory once. A remote tier (`url`)
    loads only its tokenizer."""
    ensure_models(settings)
    shared = [t for t in settings.tiers.values() if t.kv_cache_bytes is None and not t.is_remote]
    budget = KVBudget(int(settings.kv_pool_bytes)) if shared else None
    loaded: dict[tuple, AsyncEngine] = {}
    engines: dict[str, AsyncEngine] = {}
    remote: dict[str, TierEngine] = {}
    # Draft tiers first: the tiers they draft for need their models.
    order = sorted(settings.tiers, key=lambda n: settings.tiers[n].speculative == "draft")
    for name in order:
        tier = settings.tiers[name]
        if tier.is_remote:
            remote[name] = load_remote(settings, name, tier)
            continue
        draft = engines[tier.draft_tier].engine if tier.speculative == "draft" and tier.draft_tier else None
        kv_tier = (tier.kv_tier, tier.kv_tier_min_blocks)
        key = (str(settings.model_dir(tier)), tier.dtype, tier.weights, engine_config(tier), tier.draft_tier, kv_tier)
        if key not in loaded:
            engine = _load(settings, name, tier, draft, budget if tier.kv_cache_bytes is None else None)
            loaded[key] = AsyncEngine(engine, name=name, threads=tier.threads or settings.max_threads)
        engines[name] = loaded[key]
    tiers: dict[str, TierEngine] = {**engines, **remote}
    check_fallbacks(settings, tiers)
    return {name: tiers[name] for name in settings.tiers}


def load_tier_engine(settings: Settings, name: str) -> Engine:
    """One local tier's engine, loaded alone and not started (its thread is the caller's): for offline work
    on that tier, such as computing the router's hidden-state features."""
    engine = load_engines(settings.model_copy(update={"tiers": {name: settings.tiers[name]}}))[name]
    if not isinstance(engine, AsyncEngine):
        raise ValueError(f"tier {name!r} is remote: it runs no engine here")
    return engine.engine


def load_remote(settings: Settings, name: str, tier: TierSettings) -> RemoteEngine:
    """A tier another server generates for: its tokenizer and context length from `model`, calls to `url`."""
    assert tier.url is not None
    try:
        api_key = tier.remote_api_key()
    except ValueError as exc:
        raise ValueError(f"tier {name!r}: {exc}") from None
    config = RemoteConfig(
        url=tier.url,
        model=tier.remote_model or tier.model,
        embedding_model=tier.embedding_model,
        api_key=api_key,
        timeout_s=tier.timeout_s,
        connect_timeout_s=tier.connect_timeout_s,
        read_timeout_s=tier.read_timeout_s,
        max_connections=tier.max_connections,
        max_retries=tier.max_retries,
        breaker_failures=tier.breaker_failures,
        breaker_cooldown_s=tier.breaker_cooldown_s,
        prompt_format=tier.prompt_format,
    )
    model_dir = settings.float_dir(tier)
    engine = RemoteEngine.from_dir(model_dir.expanduser(), config, name=name, max_model_len=tier.max_model_len)
    log.info("tier %s: remote %s at %s, tokenized as %s", name, config.model, config.url, tier.model)
    return engine


def check_fallbacks(settings: Settings, engines: Mapping[str, TierEngine]) -> None:
    """A fallback serves the very prompt ids its tier tokenized, so both must share one vocabulary."""
    for name, tier in settings.tiers.items():
        if (fallback := tier.fallback) is None:
            continue
        if engines[name].tokenizer.hf.get_vocab() != engines[fallback].tokenizer.hf.get_vocab():
            raise ValueError(
                f"tier {name!r}: fallback {fallback!r} tokenizes with another vocabulary, so it cannot serve "
                "this tier's prompts; pick a fallback with the same tokenizer"
            )


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
    device = tier.device if tier.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine(
        load_model(model_dir, tier.dtype, weights, device=device),
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
