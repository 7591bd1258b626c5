"""The engine: requests in, one `step` at a time, outputs out.

Each step the scheduler picks which sequences compute how many tokens, the model runner computes them
in one batched forward over the paged KV cache and samples, and the engine turns sampled tokens into
outputs, registers newly full blocks in the prefix cache and frees the blocks of finished requests.
"""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.block_manager import BlockManager, BlockTable
from engines.checkpoints.loader import load_model
from engines.detokenizer import IncrementalDetokenizer
from engines.kv.budget import KVBudget
from engines.kv.cache import PagedKVCache, bytes_per_block
from engines.kv.tier import KVTier, TierLink
from engines.model_runner import Chunk, ModelRunner
from engines.models.llama import LlamaForCausalLM
from engines.request import EngineRequest, FinishReason, GenerationHook, RequestOutput, TokenLogprob
from engines.sampling import sample
from engines.scheduler import Scheduler
from engines.sequence import Sequence
from engines.speculative.acceptance import accept
from engines.speculative.proposers import Draft, DraftProposer, NgramProposer
from engines.speculative.speculator import SpeculativeConfig, Speculator
from engines.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engines.structured import GrammarCompiler


class RequestRejected(ValueError):
    """The request cannot be served as asked (too long, bad token ids); the message says why."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> tuple[TokenLogprob, ...]:
    """Row j of `logits` is the distribution token j was drawn from: its log-probability and the k most
    likely alternatives, under the model (before temperature, top-k/top-p and penalties)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top_p, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    return tuple(
        TokenLogprob(t, c, tuple(zip(ids, ps, strict=True)))
        for t, c, ids, ps in zip(tokens, chosen, top_i.tolist(), top_p.tolist(), strict=True)
    )


def check_context(prompt_token_ids: list[int], max_tokens: int, max_model_len: int) -> None:
    """Raise `RequestRejected` for an empty prompt or one that with `max_tokens` passes the context."""
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


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 1 << 30  # the KV pool, preallocated (pages are touched as blocks fill)
    max_num_seqs: int = 64  # sequences per step
    max_num_batched_tokens: int = 512  # tokens per step: the prefill chunk size when decodes are few
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's own context
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "int8": per-vector scales, ~2x the blocks
    cuda_graphs: bool = True  # on CUDA: decode steps replay captured graphs (ignored elsewhere)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_utilization: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    evictions: int
    preemptions: int
    steps: int
    tokens_computed: int  # prompt and generated tokens that went through the model
    tokens_generated: int
    step_ms_p50: float  # over the last 100 steps
    step_tokens_p50: float
    block_size: int
    kv_cache_bytes: int
    kv_budget_bytes: int  # the byte budget this engine shares with other tiers (0: a pool of its own)
    kv_budget_used_bytes: int  # of it, in use by every engine drawing on it
    speculative: dict[str, float | int]  # proposed, accepted, acceptance rate, mean accepted length
    kv_tier: dict[str, float | int] = field(default_factory=dict)  # kv_tier_*: blocks, bytes, errors (if on)

    def as_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        return {**d, **d.pop("speculative"), **d.pop("kv_tier")}


class Engine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        *,
        name: str = "",
        draft_model: LlamaForCausalLM | None = None,
        kv_budget: KVBudget | None = None,
        kv_tier: KVTier | None = None,
    ) -> None:
        """`draft_model`: the proposer for `config.speculative.method == "draft"` (same tokenizer).
        `kv_budget`: a KV budget shared with other engines, in place of `config.kv_cache_bytes`.
        `kv_tier`: long prompt prefixes' KV blocks shared through Redis (one tier object per engine)."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        cfg = model.config
        self.max_model_len = min(cfg.max_position_embeddings, config.max_model_len or cfg.max_position_embeddings)
        self.dtype = model.dtype
        kv_dtypes = {"auto": self.dtype, "int8": torch.int8}
        if config.kv_cache_dtype not in kv_dtypes:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(kv_dtypes)}, not {config.kv_cache_dtype!r}")
        kv_dtype = kv_dtypes[config.kv_cache_dtype]
        per_block = bytes_per_block(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, config.block_size, self.dtype, kv_dtype
        )
        self.kv_budget = kv_budget
        num_blocks = (kv_budget.total_bytes if kv_budget else config.kv_cache_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {per_block} bytes")
        graphs = config.cuda_graphs and model.device.type == "cuda"
        self.cache = PagedKVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            num_blocks + graphs,  # CUDA graphs: one scratch block past the manager's, for padding rows
            config.block_size,
            self.dtype,
            kv_dtype,
            device=model.device,
        )
        owner = name or cfg.architecture
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            budget=kv_budget,
            block_bytes=per_block,
            owner=owner,
        )
        # What the tier's blocks must match besides the checkpoint: anything that changes the bytes.
        layout = (
            f"{model.weights_format}|{self.dtype}|kv={kv_dtype}|bs={config.block_size}"
            f"|{cfg.num_hidden_layers}x{cfg.num_key_value_heads}x{cfg.head_dim}"
        )
        self.kv_tier = None if kv_tier is None else TierLink(kv_tier, self.cache, self.block_manager, layout)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            restore=None if self.kv_tier is None else self.kv_tier.restore,
        )
        self.runner = ModelRunner(model, self.cache)
        if graphs:
            self.runner.enable_cuda_graphs(num_blocks, -(-self.max_model_len // config.block_size))
        # The model is part of every block hash: a shared pool never mixes two models' keys.
        self.salt = name or f"{cfg.architecture}:{cfg.hidden_size}x{cfg.num_hidden_layers}:{self.dtype}"
        self.speculator = self._speculator(config.speculative, draft_model)
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self._steps = self._computed = self._generated = 0
        self._recent: deque[tuple[float, int]] = deque(maxlen=100)  # (step seconds, tokens)

    def _speculator(self, spec: SpeculativeConfig, draft_model: LlamaForCausalLM | None) -> Speculator | None:
        if spec.method == "off":
            return None
        if spec.method == "ngram":
            return Speculator(spec, NgramProposer(spec.ngram_max, spec.ngram_min))
        if draft_model is None:
            raise ValueError('speculative method "draft" needs a draft model')
        if draft_model.config.vocab_size > self.model.config.vocab_size:
            raise ValueError("the draft model's vocabulary is larger than the target's")
        proposer = DraftProposer(
            draft_model,
            spec.draft_kv_cache_bytes,
            self.config.block_size,
            salt=f"draft|{self.salt}",
            budget=self.kv_budget,
        )
        if spec.draft_vocab:
            from engines.speculative.draft_head import frequent_token_ids

            vocab = draft_model.config.vocab_size
            proposer.runner.restrict_vocab(frequent_token_ids(self.tokenizer, vocab, spec.draft_vocab))
        return Speculator(spec, proposer)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        dtype: str = "bf16",
        config: EngineConfig | None = None,
        name: str = "",
        weights: str | None = None,
        draft_dir: str | Path | None = None,
        draft_weights: str | None = None,
        kv_budget: KVBudget | None = None,
        kv_tier: KVTier | None = None,
        device: str = "cpu",
    ) -> Engine:
        """`weights`: None serves the directory as stored, "int8"/"int4" quantize while loading;
        `draft_dir`/`draft_weights`: the draft model for speculative method "draft"; `device`: where the
        models and the KV pool live (the sampler stays on the CPU)."""
        draft = None if draft_dir is None else load_model(draft_dir, dtype, draft_weights, device=device)
        model = load_model(model_dir, dtype, weights, device=device)
        return cls(
            model, Tokenizer(model_dir), config, name=name, draft_model=draft, kv_budget=kv_budget, kv_tier=kv_tier
        )

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars for this engine's tokenizer and vocabulary (built on first use)."""
        from engines.structured import GrammarCompiler

        return GrammarCompiler(self.tokenizer, self.model.config.vocab_size)

    def check(self, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Raise `RequestRejected` if this prompt and token budget cannot be served."""
        check_context(prompt_token_ids, max_tokens, self.max_model_len)
        n = len(prompt_token_ids)
        # A sequence must fit in the pool on its own, or preemption could never make room for it.
        capacity = self.block_manager.num_blocks * self.config.block_size
        if n + max_tokens > capacity:
            raise RequestRejected(
                f"This server's KV cache holds {capacity} tokens per sequence; you requested {n + max_tokens}. "
                "Please reduce the length of the messages or completion.",
                code="context_length_exceeded",
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected(f"prompt token ids must lie in [0, {vocab})")

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._seqs:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        params = request.params
        self.check(request.prompt_token_ids, params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        )
        detok = IncrementalDetokenizer(self.tokenizer.backend, params.stop)
        table = BlockTable(salt=f"{self.salt}|{request.cache_salt}")
        seq = Sequence(request, detok, stop_ids, table, arrival=next(self._arrival))
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; None if it is not here (finished or unknown)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self._finish(seq)
        seq.finish_reason = FinishReason.ABORT
        return seq.output([])

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self._seqs)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        drafts: dict[int, Draft] = {}
        if self.speculator is not None:
            budget = self.config.max_num_batched_tokens - batch.num_tokens
            drafts = self.speculator.propose(batch, self.block_manager, self.max_model_len, budget)
        if fresh := self.block_manager.first_use:
            self.cache.zero_blocks(fresh)
            fresh.clear()
        chunks = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True)):
            done = seq.num_computed
            draft = drafts[i].tokens if i in drafts else []
            ends = done + n == len(seq.token_ids)
            chunks.append(
                Chunk(seq.token_ids[done : done + n] + draft, done, seq.block_table.block_ids, ends + len(draft))
            )
        forward_started = time.perf_counter()
        logits = self.runner.forward(chunks)
        if self.kv_tier is not None:  # what computing a prompt block costs, the tier's yardstick
            prompt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > c.num_logits)
            total = sum(len(c.token_ids) for c in chunks)
            self.kv_tier.observe_prefill(prompt, total, time.perf_counter() - forward_started)
        if self.speculator is not None and all(len(c.token_ids) == c.num_logits for c in chunks):
            # Decode and verification steps only: prefill chunks cost per token what decode rows don't.
            self.speculator.record_step(sum(len(c.token_ids) for c in chunks), time.perf_counter() - forward_started)
        plain = [i for i, c in enumerate(chunks) if c.num_logits and i not in drafts]
        rows = [0, *itertools.accumulate(c.num_logits for c in chunks)]  # each chunk's first logits row
        for i in plain:
            if (constraint := batch.seqs[i].constraint) is not None:
                constraint.mask(logits[rows[i]])  # in place: only tokens the grammar allows can be drawn
        sampled = dict(
            zip(plain, sample(logits[[rows[i] for i in plain]], [batch.seqs[i].sampling for i in plain]), strict=True)
        )
        outputs = []
        watched: list[tuple[GenerationHook, RequestOutput]] = []  # outputs of requests with a hook
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new, strict=True)):
            if i in drafts:
                draft = drafts[i]
                tokens = accept(
                    logits[rows[i] : rows[i] + len(draft.tokens) + 1], draft.tokens, draft.probs, seq.sampling
                )
            elif i in sampled:
                tokens = [sampled[i]]
            else:
                seq.num_computed += n  # a prefill chunk that has not reached the end of its prompt yet
                self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
                continue
            appended = []
            for token in tokens:
                seq.append(token, self.max_model_len)
                appended.append(token)
                if seq.finish_reason is not None:
                    break
            hook = seq.request.hook
            logprobs: tuple[TokenLogprob, ...] = ()
            if hook is not None and hook.top_logprobs > 0:  # token j was sampled from logits row rows[i] + j
                logprobs = token_logprobs(logits[rows[i] : rows[i] + len(appended)], appended, hook.top_logprobs)
            # Every token but the newest now has its KV: after a verification, the last token and the
            # kept drafts; the rejected drafts' positions roll back and their blocks go back.
            seq.num_computed = len(seq.token_ids) - 1
            if i in drafts:
                self.block_manager.truncate(seq.block_table, seq.num_computed)
            self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
            if self.kv_tier is not None and seq.num_generated == len(appended):  # its prompt just completed
                self.kv_tier.offload(seq)
            if i in drafts and self.speculator is not None:
                self.speculator.verified(seq, len(drafts[i].tokens), len(tokens) - 1, len(appended))
                seq.draft_proposed += len(drafts[i].tokens)
                seq.draft_accepted += min(len(tokens) - 1, len(appended))  # billed: never past the end
            outputs.append(seq.output(appended, logprobs))
            if hook is not None:
                watched.append((hook, outputs[-1]))
            if seq.finish_reason is not None:
                del self._seqs[seq.request_id]
                self._finish(seq)
        if watched:
            outputs += self._run_hooks(watched)
        if self.speculator is not None:
            started_now = [seq for seq in batch.seqs if seq.num_generated == 1 and seq.finish_reason is None]
            if started_now:
                self.speculator.prefilled(len(batch.seqs), started_now)
        self._steps += 1
        self._computed += sum(len(c.token_ids) for c in chunks)
        self._generated += sum(len(o.new_token_ids) for o in outputs)
        self._recent.append((time.perf_counter() - started, batch.num_tokens))
        return outputs

    def _run_hooks(self, watched: list[tuple[GenerationHook, RequestOutput]]) -> list[RequestOutput]:
        """Show this step's outputs to their requests' hooks; end the sequences the hooks decide to end,
        as an abort does (blocks freed at once), and return those sequences' final outputs."""
        hooks: dict[int, GenerationHook] = {}
        for hook, out in watched:
            hook.observe(out)
            hooks[id(hook)] = hook
        ended = []
        for hook in hooks.values():
            for request_id, reason in hook.decide().items():
                seq = self._seqs.pop(request_id, None)
                if seq is None:  # finished already (or not this engine's)
                    continue
                self._finish(seq)
                seq.finish_reason = reason
                ended.append(seq.output([]))
        return ended

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def stats(self) -> EngineStats:
        kv = self.block_manager.stats()
        recent = list(self._recent)
        return EngineStats(
            waiting=len(self.scheduler.waiting),
            running=len(self.scheduler.running),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.used,
            kv_blocks_free=kv.free,
            kv_blocks_cached=kv.cached,
            kv_utilization=round(kv.utilization, 4),
            prefix_queried_tokens=kv.prefix_queried_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            prefix_hit_rate=round(kv.prefix_hit_rate, 4),
            evictions=kv.evictions,
            preemptions=self.scheduler.num_preemptions,
            steps=self._steps,
            tokens_computed=self._computed,
            tokens_generated=self._generated,
            step_ms_p50=round(statistics.median(s for s, _ in recent) * 1000, 3) if recent else 0.0,
            step_tokens_p50=statistics.median(n for _, n in recent) if recent else 0.0,
            block_size=self.config.block_size,
            kv_cache_bytes=self.cache.nbytes,
            kv_budget_bytes=self.kv_budget.total_bytes if self.kv_budget else 0,
            kv_budget_used_bytes=self.kv_budget.used_bytes if self.kv_budget else 0,
            speculative=self.speculator.stats.as_dict() if self.speculator else {},
            kv_tier=self.kv_tier.stats.as_dict() if self.kv_tier else {},
        )
