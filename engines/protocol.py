"""What the gateway needs of a tier's engine, in-process (`AsyncEngine`) or remote (`RemoteEngine`).

Light on purpose: the request and tokenizer types are only named in annotations, so the gateway imports
`RequestRejected` and `EngineUnavailable` from here without loading torch.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engines.block_manager import BlockStats
    from engines.request import EngineRequest, RequestOutput
    from engines.structured import GrammarCompiler
    from engines.tokenizer import Tokenizer


class RequestRejected(ValueError):
    """The request cannot be served as asked (too long, bad token ids); the message says why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class EngineUnavailable(RuntimeError):
    """The engine takes no requests now (stopped, dead, or its remote unreachable). Raised by `open`, or by
    the stream's first `__anext__` for an engine that only finds out on the way (a remote)."""


def check_context(
    prompt_token_ids: list[int],
    max_tokens: int,
    max_model_len: int,
    *,
    kv_capacity: int | None = None,
    vocab_size: int | None = None,
) -> None:
    """Raise `RequestRejected` for an empty prompt or one that with `max_tokens` passes the context (or a KV
    pool's `kv_capacity` in tokens), or for token ids outside the vocabulary."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejected("the prompt is empty")
    if n + max_tokens > max_model_len:
        raise RequestRejected(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
        )
    # A sequence must fit in the pool on its own, or preemption could never make room for it.
    if kv_capacity is not None and n + max_tokens > kv_capacity:
        raise RequestRejected(
            f"This server's KV cache holds {kv_capacity} tokens per sequence; you requested {n + max_tokens}. "
            "Please reduce the length of the messages or completion.",
            code="context_length_exceeded",
        )
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise RequestRejected(f"prompt token ids must lie in [0, {vocab_size})")


class OutputStream(Protocol):
    """The outputs of a group of requests; leaving early means `aclose()`, which aborts what is unfinished."""

    last: dict[str, RequestOutput]  # each request's latest output: its token counts so far, or final

    def __aiter__(self) -> OutputStream: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


class Stats(Protocol):
    def as_dict(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class QueueStats:
    waiting: int
    running: int


@dataclass(frozen=True)
class BlockUse:
    """The paged pool's blocks and its prefix cache."""

    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_utilization: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    evictions: int

    @classmethod
    def of(cls, kv: BlockStats) -> BlockUse:
        return cls(
            kv.num_blocks, kv.used, kv.free, kv.cached, round(kv.utilization, 4), kv.prefix_queried_tokens,
            kv.prefix_hit_tokens, round(kv.prefix_hit_rate, 4), kv.evictions,
        )  # fmt: skip


@dataclass(frozen=True)
class StepWork:
    """What the step loop did."""

    preemptions: int
    steps: int
    tokens_computed: int  # prompt and generated tokens that went through the model
    tokens_generated: int
    step_ms_p50: float  # over the last 100 steps
    step_tokens_p50: float


class StepMeter:
    """Counts the engine's steps: tokens through the model and generated, and each step's time and size."""

    def __init__(self) -> None:
        self.steps = self.computed = self.generated = 0
        self.recent: deque[tuple[float, int]] = deque(maxlen=100)  # (step seconds, scheduled tokens)

    def record(self, seconds: float, scheduled: int, computed: int, generated: int) -> None:
        self.steps += 1
        self.computed += computed
        self.generated += generated
        self.recent.append((seconds, scheduled))

    def work(self, preemptions: int) -> StepWork:
        recent = list(self.recent)
        return StepWork(
            preemptions=preemptions,
            steps=self.steps,
            tokens_computed=self.computed,
            tokens_generated=self.generated,
            step_ms_p50=round(statistics.median(s for s, _ in recent) * 1000, 3) if recent else 0.0,
            step_tokens_p50=statistics.median(n for _, n in recent) if recent else 0.0,
        )


@dataclass(frozen=True)
class KVMemory:
    block_size: int
    kv_cache_bytes: int
    kv_budget_bytes: int  # the byte budget this engine shares with other tiers (0: a pool of its own)
    kv_budget_used_bytes: int  # of it, in use by every engine drawing on it


@dataclass(frozen=True)
class EngineStats:
    """An in-process engine's counters, in groups. `as_dict` flattens them (the /v1/engine/stats body, the
    metrics), and the flat names read as attributes too: `stats.running` is `stats.queue.running`."""

    queue: QueueStats
    blocks: BlockUse
    work: StepWork
    memory: KVMemory
    speculative: dict[str, float | int]  # proposed, accepted, acceptance rate, mean accepted length
    kv_tier: dict[str, float | int] = field(default_factory=dict)  # kv_tier_*: blocks, bytes, errors (if on)
    # Whose kernels run the model: "triton" (CUDA), a native CPU build ("avx2", "avx512-vnni") or "torch".
    kernels: str = ""

    def as_dict(self) -> dict[str, Any]:
        """Every group's fields in order, then `speculative` and `kv_tier` both as they are and spread out,
        then `kernels`."""
        flat = {k: v for g in (self.queue, self.blocks, self.work, self.memory) for k, v in asdict(g).items()}
        spec, tier = dict(self.speculative), dict(self.kv_tier)
        return flat | {"speculative": spec, "kv_tier": tier} | spec | tier | {"kernels": self.kernels}


def _flat_name(group: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, group), name), doc=f"`{group}.{name}`")


for _group, _cls in {"queue": QueueStats, "blocks": BlockUse, "work": StepWork, "memory": KVMemory}.items():
    for _name in _cls.__dataclass_fields__:  # `stats.running`, as before the grouping
        setattr(EngineStats, _name, _flat_name(_group, _name))


class TierEngine(Protocol):
    name: str

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    @property
    def grammars(self) -> GrammarCompiler | None:
        """Structured-output grammars for this engine's vocabulary; None if it cannot constrain its output."""

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise `RequestRejected` if the request cannot be served as asked."""

    def open(self, requests: list[EngineRequest]) -> OutputStream: ...

    def stats(self) -> Stats: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...
