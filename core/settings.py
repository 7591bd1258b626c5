"""The one settings object: environment (`SWITCHBOARD_*`) over an optional TOML file over defaults.

The TOML file is `$SWITCHBOARD_CONFIG` if set, else `./switchboard.toml` if present. Nested values
from the environment use `__`, e.g. `SWITCHBOARD_TIERS__SMALL__DTYPE=fp32`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from engines.checkpoints.fetch import model_dir as registry_model_dir
from engines.checkpoints.fetch import quantized_dir
from engines.checkpoints.registry import REGISTRY

DEFAULT_HOME = Path("~/.cache/switchboard")


class TierSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "smollm2-135m-instruct", description="registry model name, path to a HF directory or to a GGUF file"
    )
    dtype: Literal["bf16", "fp32"] = "bf16"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the model and its KV pool live; auto: CUDA where present (Triton kernels)"
    )
    weights: Literal["bf16", "int8", "int4"] = Field(
        "bf16", description="linear weights: bf16, int8 (per channel) or int4 (groups of 32)"
    )
    threads: int | None = Field(None, ge=1, description="torch threads for this tier; default: all CPUs")
    max_model_len: int | None = Field(None, ge=16, description="context limit; default: the model's")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache block")
    kv_cache_bytes: ByteSize | None = Field(
        None, description='a KV pool of its own, e.g. "512MiB"; default: draw from the shared `kv_pool_bytes`'
    )
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one engine step")
    max_num_batched_tokens: int = Field(512, ge=1, description="most tokens in one step (the prefill chunk)")
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto", description='"int8" stores keys and values in int8 with per-token scales: ~2x the tokens'
    )
    kv_tier: bool = Field(
        False, description="share long prompt prefixes' KV blocks through Redis (`redis_url`): replicas skip prefill"
    )
    kv_tier_min_blocks: int = Field(4, ge=1, description="prompts with fewer full KV blocks stay out of the KV tier")

    speculative: Literal["off", "ngram", "draft"] = Field(
        "off", description="speculative decoding: n-gram lookup, or a smaller tier (`draft_tier`) drafting"
    )
    draft_tier: str | None = Field(None, description='the tier whose model drafts for this one ("draft")')
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="most drafted tokens per step")
    draft_vocab: int = Field(0, ge=0, description="> 0: the draft proposes only this many frequent tokens")

    # A remote tier: another OpenAI-compatible server generates; `model` then only names the tokenizer
    # (and context length) prompts are tokenized with here.
    url: str | None = Field(None, description="root URL of an OpenAI-compatible server serving this tier")
    remote_model: str | None = Field(None, description="the model name the remote serves; default: `model`")
    embedding_model: str | None = Field(
        None, description="the model the remote's /v1/embeddings serves (`model: <this tier>`); default: remote_model"
    )
    api_key: SecretStr | None = Field(None, description="bearer key for the remote")
    api_key_env: str | None = Field(None, description="name of an environment variable holding the remote's key")
    timeout_s: float = Field(600.0, gt=0, description="a remote call from start to last token, retries included")
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0, description="the longest silence between two streamed chunks")
    max_connections: int = Field(100, ge=1, description="pooled connections to the remote")
    max_retries: int = Field(2, ge=0, le=10, description="retries of a remote call that failed before its first token")
    breaker_failures: int = Field(5, ge=1, description="consecutive remote failures that open the circuit")
    breaker_cooldown_s: float = Field(30.0, gt=0, description="how long an open circuit refuses calls")
    prompt_format: Literal["tokens", "text"] = Field(
        "tokens",
        description="prompts go to the remote as token ids, or as their text for servers that take only text "
        "(llama-cpp-python's)",
    )
    fallback: str | None = Field(None, description="the tier serving this one's requests while it is down")

    @property
    def is_registry_model(self) -> bool:
        return self.model in REGISTRY

    @property
    def is_gguf(self) -> bool:
        """`model` is a path to a GGUF file (converted once into the models cache)."""
        return self.model.endswith(".gguf")

    @property
    def is_remote(self) -> bool:
        return self.url is not None

    def remote_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env is None:
            return None
        if (key := os.environ.get(self.api_key_env)) is None:
            raise ValueError(f"api_key_env names {self.api_key_env}, which is not set")
        return key


# Named sets of tiers. default: the product's shape, the tier ladder `auto` routes on: SmolLM2-135M
# (greetings, short facts, rewording) below a 0.5B and a 1.5B Qwen2.5-Coder sharing a tokenizer, all int8
# (bf16 crawls on CPUs without AVX-512; int8 is within 0.2% perplexity). tiny: SmolLM2 alone, for tests
# and quick starts.
PROFILES: dict[str, dict[str, dict]] = {
    "default": {
        "tiny": {"model": "smollm2-135m-instruct", "weights": "int8"},
        "small": {"model": "qwen2.5-coder-0.5b-instruct", "weights": "int8"},
        "large": {"model": "qwen2.5-coder-1.5b-instruct", "weights": "int8"},
    },
    "tiny": {"small": {"model": "smollm2-135m-instruct"}},
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_", env_nested_delimiter="__", extra="forbid")

    home: Path = Field(DEFAULT_HOME, description="models, the embedded database and other state")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default: SQLite under home")
    redis_url: str | None = Field(None, description="budgets and rate limits shared by replicas; default: in-process")
    redis_namespace: str = Field("sb", description="prefix of every Redis key this gateway writes")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    profile: Literal["default", "tiny"] = Field("default", description="the tiers served when `tiers` is not set")
    tiers: dict[str, TierSettings] = Field(default_factory=dict, description="name → tier; default: the profile's")
    kv_pool_bytes: ByteSize = Field(
        ByteSize(1 << 30), description="KV memory every tier without its own `kv_cache_bytes` draws from"
    )
    max_request_bytes: int = Field(1 << 20, ge=1024, description="larger bodies get HTTP 413")
    max_adapter_bytes: int = Field(
        1 << 30, ge=1024, description="the most an adapter upload may be (rank 64 on every projection of a 7B: ~640 MB)"
    )
    max_n: int = Field(8, ge=1, description="most choices one request may ask for")
    default_max_tokens: int | None = Field(None, ge=1, description="when a request sets none; default: context left")
    auto_fetch: bool = Field(True, description="fetch registry models the tiers need on start")
    auto_migrate: bool = Field(True, description="bring the database schema up to date on start")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_format: Literal["json", "text"] = Field("json", description="json: one object per line, with request ids")
    metrics_public: bool = Field(True, description="serve GET /metrics without a key; off: an admin key is needed")
    console_secret: str | None = Field(
        None, description="signs web console sessions; default: random per process (a restart signs everyone out)"
    )
    key_secret: SecretStr | None = Field(
        None, description="HMAC secret for stored API keys; replicas must share it; default: `key-secret` in home"
    )
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        "tenant", description="tenant: cached prompt prefixes are reused only within a tenant"
    )
    model_aliases: dict[str, str] = Field(
        default_factory=lambda: {"text-embedding-3-small": "minilm", "text-embedding-ada-002": "minilm"},
        description="operator-wide: a model name apps send → the tier, `auto` or embedding model that serves it "
        "(a tenant's policy `aliases` come first)",
    )
    responses_retention_days: float = Field(
        30.0, gt=0, description="how long a stored Responses API response (`store: true`) is kept, as OpenAI's 30 days"
    )
    router_dir: Path | None = Field(None, description='the trained router `model: "auto"` uses; default: home/router')
    router_hidden_max_waiting: int = Field(
        8, ge=0, description="a router on the small tier's hidden state routes on text when more wait in that queue"
    )
    router_hidden_timeout_s: float = Field(
        5.0, gt=0, description="a router on the hidden state routes on text when the small tier's prefill takes longer"
    )
    router_auto_train: bool = Field(
        True, description="on start, train the router from the shipped labels where there is none (or an outdated one)"
    )
    shadow_runs: bool = Field(
        True, description="run the shadow relabeling tenants' policies ask for (router.shadow_share); off: none run"
    )
    probe_dir: Path | None = Field(None, description="the answer probe policy check `probe` uses; default: home/probe")
    router_threads: int = Field(1, ge=1, description="torch threads of the routing thread (the engines use the rest)")
    tuning_check_seconds: float = Field(
        3600.0, ge=0.0, description="how often tenants' tuning schedules are checked for a due run; 0: never"
    )
    distill_check_seconds: float = Field(
        3600.0, ge=0.0, description="how often tenants' distill schedules are checked for a due run; 0: never"
    )

    @model_validator(mode="after")
    def _tiers(self) -> Settings:
        if not self.tiers:
            self.tiers = {name: TierSettings(**tier) for name, tier in PROFILES[self.profile].items()}
        if "auto" in self.tiers:
            raise ValueError('no tier may be named "auto": `model: "auto"` asks the router to pick one')
        for name, tier in self.tiers.items():
            if tier.speculative == "draft" and (tier.draft_tier not in self.tiers or tier.draft_tier == name):
                raise ValueError(f"tier {name!r}: draft_tier must name another tier, not {tier.draft_tier!r}")
            _check_remote(name, tier, self.tiers)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_file = os.environ.get("SWITCHBOARD_CONFIG", "switchboard.toml")
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=toml_file)

    @property
    def home_dir(self) -> Path:
        return self.home.expanduser()

    @property
    def router_path(self) -> Path:
        return self.router_dir.expanduser() if self.router_dir else self.home_dir / "router"

    @property
    def probe_path(self) -> Path:
        return self.probe_dir.expanduser() if self.probe_dir else self.home_dir / "probe"

    @property
    def database(self) -> str:
        return self.database_url or f"sqlite:///{self.home_dir / 'switchboard.db'}"

    def model_dir(self, tier: TierSettings) -> Path:
        if tier.is_registry_model and tier.weights != "bf16":
            return quantized_dir(self.home_dir, tier.model, tier.weights)
        if tier.is_registry_model:
            return registry_model_dir(self.home_dir, tier.model)
        if tier.is_gguf:
            from engines.checkpoints.gguf_convert import gguf_model_dir

            return gguf_model_dir(self.home_dir, Path(tier.model))
        return Path(tier.model).expanduser()

    def float_dir(self, tier: TierSettings) -> Path:
        """The tier's float checkpoint: a registry model's own download (what its quantized copy, or a remote
        tier's tokenizer, comes from), else `model_dir`."""
        return registry_model_dir(self.home_dir, tier.model) if tier.is_registry_model else self.model_dir(tier)

    @property
    def max_threads(self) -> int:
        return max((t.threads or os.cpu_count() or 1) for t in self.tiers.values())


def settings_environment(settings: Settings) -> dict[str, str]:
    """`SWITCHBOARD_*` variables from which a child process's `Settings()` is these settings (with its
    `SWITCHBOARD_CONFIG` pointing nowhere, so no TOML file adds to them): how the gateway hands its own settings to
    a command it runs. Secrets are passed in the clear: the environment of one's own child."""

    def plain(value: object) -> object:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if v is not None}
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        return str(value) if isinstance(value, Path) else value

    out = {}
    for name, value in settings.model_dump(mode="python", exclude_none=True).items():
        value = plain(value)
        out[f"SWITCHBOARD_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def _check_remote(name: str, tier: TierSettings, tiers: dict[str, TierSettings]) -> None:
    """Remote tiers run no model here, and fallbacks must end somewhere."""
    if tier.is_remote and (tier.speculative != "off" or tier.kv_tier):
        raise ValueError(f"tier {name!r} is remote (url): it cannot speculate or use the KV tier")
    if tier.speculative == "draft" and tier.draft_tier and tiers[tier.draft_tier].is_remote:
        raise ValueError(f"tier {name!r}: draft tier {tier.draft_tier!r} is remote; a draft must run here")
    seen = [name]
    while (fallback := tiers[seen[-1]].fallback) is not None:
        if fallback not in tiers:
            raise ValueError(f"tier {seen[-1]!r}: fallback {fallback!r} is not a tier; tiers: {', '.join(tiers)}")
        if fallback in seen:
            raise ValueError(f"tier fallbacks form a cycle: {' -> '.join([*seen, fallback])}")
        seen.append(fallback)
