"""The engine: requests in, one `step` at a time, outputs out.

Each step the scheduler picks which sequences compute how many tokens (`_schedule`), the model runner
computes them in one batched forward over the paged KV cache (`_forward`), the sampler picks each finished
target's next token or the verifier keeps drafted ones (`_sample`), and the engine turns the tokens into
outputs, registers newly full blocks in the prefix cache and frees the blocks of finished requests
(`_postprocess`).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engines.block_manager import BlockManager, BlockTable
from engines.checkpoints.loader import load_model
from engines.detokenizer import IncrementalDetokenizer
from engines.kernels.backends import backend_for
from engines.kv.budget import KVBudget
from engines.kv.cache import PagedKVCache, bytes_per_block
from engines.kv.tier import KVTier
from engines.kv.tier_link import TierLink
from engines.lora.adapter import LoraAdapter
from engines.lora.registry import Adapters
from engines.model_runner import Chunk, ModelRunner
from engines.models.llama import LlamaForCausalLM
from engines.protocol import BlockUse, EngineStats, KVMemory, QueueStats, RequestRejected, StepMeter, check_context
from engines.request import EngineRequest, FinishReason, GenerationHook, RequestOutput, TokenLogprob
from engines.sampling import plain_greedy, sample
from engines.scheduler import ScheduledBatch, Scheduler
from engines.sequence import Sequence
from engines.speculative.acceptance import accept
from engines.speculative.proposers import Draft
from engines.speculative.speculator import SpeculativeConfig, build_speculator
from engines.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engines.structured import GrammarCompiler

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestRejected", "check_context", "token_logprobs"]


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


@dataclass
class StepPlan:
    """One step's work: the scheduled batch, the drafts of its speculating sequences (by batch index),
    and per sequence the chunk of tokens the model computes (its drafts appended)."""

    batch: ScheduledBatch
    drafts: dict[int, Draft]
    chunks: list[Chunk]
    rows: list[int] = field(init=False)  # each chunk's first row in the step's logits

    def __post_init__(self) -> None:
        self.rows = [0, *itertools.accumulate(c.num_logits for c in self.chunks)]

    @property
    def num_tokens(self) -> int:
        """Tokens through the model, drafts included."""
        return sum(len(c.token_ids) for c in self.chunks)


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
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        per_block = bytes_per_block(*shape, config.block_size, self.dtype, kv_dtype)
        self.kv_budget = kv_budget
        num_blocks = (kv_budget.total_bytes if kv_budget else config.kv_cache_bytes) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {per_block} bytes")
        # The graphs' static buffers are read only by backends that take everything from
        # `AttentionMetadata.rows` (Triton's); the torch reference on CUDA runs eagerly.
        graphs = config.cuda_graphs and model.device.type == "cuda" and backend_for(model.device).name == "triton"
        # CUDA graphs: one scratch block past the manager's, for padding rows
        self.cache = PagedKVCache(
            *shape, num_blocks + graphs, config.block_size, self.dtype, kv_dtype, device=model.device
        )
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            budget=kv_budget,
            block_bytes=per_block,
            owner=name or cfg.architecture,
        )
        link = None if kv_tier is None else TierLink(kv_tier, self.cache, self.block_manager, model.weights_format)
        self.kv_tier = link
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            restore=None if self.kv_tier is None else self.kv_tier.restore,
        )
        self.runner = ModelRunner(model, self.cache)
        # Where every layer attends over a window (Mistral), a decoding sequence's blocks the window has
        # passed go back: its KV stays bounded however long it generates. A model with any global layer
        # (Gemma 3) keeps them all: one block id holds every layer's keys.
        self.window = min(cfg.windows) if cfg.windows and all(cfg.windows) else 0
        if graphs:
            self.runner.enable_cuda_graphs(num_blocks, -(-self.max_model_len // config.block_size))
        # The model is part of every block hash: a shared pool never mixes two models' keys.
        self.salt = name or f"{cfg.architecture}:{cfg.hidden_size}x{cfg.num_hidden_layers}:{self.dtype}"
        self.speculator = build_speculator(
            config.speculative, model, draft_model, tokenizer, block_size=config.block_size, salt=self.salt,
            budget=kv_budget,
        )  # fmt: skip
        self._seqs: dict[str, Sequence] = {}
        self._arrival = itertools.count()
        self.meter = StepMeter()

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
        capacity = self.block_manager.num_blocks * self.config.block_size
        vocab = self.model.config.vocab_size
        check_context(prompt_token_ids, max_tokens, self.max_model_len, kv_capacity=capacity, vocab_size=vocab)

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._seqs:
            raise RequestRejected(f"request id {request.request_id!r} is already running")
        params = request.params
        self.check(request.prompt_token_ids, params.max_tokens)
        layers = self.model.config.num_hidden_layers
        if request.hidden_layer is not None and not 0 <= request.hidden_layer <= layers:
            raise RequestRejected(f"hidden_layer must be within 0..{layers}, not {request.hidden_layer}")
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.tokenizer.eos_token_ids
        )
        detok = IncrementalDetokenizer(self.tokenizer.backend, params.stop)
        table = BlockTable(salt=f"{self.salt}|{request.cache_salt}{self._adapter_salt(request.adapter)}")
        seq = Sequence(request, detok, stop_ids, table, arrival=next(self._arrival))
        self._seqs[request.request_id] = seq
        self.scheduler.add(seq)

    @functools.cached_property
    def adapters(self) -> Adapters:
        """The LoRA adapters this engine serves (`engines.lora`), loaded with `load_adapter`."""
        return Adapters(self.model)

    def load_adapter(self, name: str, adapter: str | Path | LoraAdapter) -> None:
        """Serve the PEFT adapter at a path (or one read already) as `name` from now on (AdapterError, loading
        nothing, if it cannot be)."""
        busy = {s.request.adapter for s in self._seqs.values() if s.request.adapter}
        if isinstance(adapter, LoraAdapter):
            self.adapters.attach(name, adapter, busy)
        else:
            self.adapters.load(name, adapter, busy)

    def unload_adapter(self, name: str) -> bool:
        """Stop serving `name` (False if it was not loaded); a running request under it is refused the unload."""
        if any(s.request.adapter == name for s in self._seqs.values()):
            raise RequestRejected(f"adapter {name!r} is in use by running requests")
        return self.adapters.unload(name)

    def _adapter_salt(self, name: str | None) -> str:
        """What a request's adapter adds to its prefix-cache salt: its digest (a prefix computed under one adapter is
        never reused under another, or under the base); RequestRejected for an adapter not loaded here."""
        if name is None:
            return ""
        adapter = self.adapters.use(name)
        if adapter is None:
            raise RequestRejected(f"adapter {name!r} is not loaded on this engine")
        return f"|adapter:{adapter.digest}"

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
        if (plan := self._schedule()) is None:
            return []
        tokens, logits = self._sample(plan, self._forward(plan))
        outputs = self._postprocess(plan, logits, tokens)
        generated = sum(len(o.new_token_ids) for o in outputs)
        seconds = time.perf_counter() - started
        self.meter.record(seconds, plan.batch.num_tokens, plan.num_tokens, generated)
        if self.speculator is not None:
            self.speculator.observe_step(plan.batch, generated, seconds, bool(plan.drafts))
        return outputs

    def _schedule(self) -> StepPlan | None:
        """The scheduler's batch, with drafts for its speculating sequences; None when nothing runs."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return None
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
            tokens, blocks = seq.token_ids[done : done + n] + draft, seq.block_table.block_ids
            adapter = seq.request.adapter
            if (layer := seq.request.hidden_layer) is not None:  # prefill only: a hidden state, no logits
                chunks.append(Chunk(tokens, done, blocks, 0, layer if ends else None, adapter))
            else:
                chunks.append(Chunk(tokens, done, blocks, ends + len(draft), adapter=adapter))
        return StepPlan(batch, drafts, chunks)

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """The step's logits; the forward's time feeds the KV tier's and the speculator's cost estimates."""
        chunks = plan.chunks
        started = time.perf_counter()
        logits = self.runner.forward(chunks, on_device=True)
        if self.kv_tier is not None:  # what computing a prompt block costs, the tier's yardstick
            prompt = sum(len(c.token_ids) for c in chunks if len(c.token_ids) > c.num_logits)
            self.kv_tier.observe_prefill(prompt, plan.num_tokens, time.perf_counter() - started)
        if self.speculator is not None and all(len(c.token_ids) == c.num_logits for c in chunks):
            # Decode and verification steps only: prefill chunks cost per token what decode rows don't.
            self.speculator.record_step(plan.num_tokens, time.perf_counter() - started)
        return logits

    def _sample(self, plan: StepPlan, logits: torch.Tensor) -> tuple[dict[int, list[int]], torch.Tensor]:
        """The tokens each sequence appends, by batch index: one sampled token where its target is computed,
        or a verification's kept drafts and one more. Prefill chunks short of their prompt's end get none.
        Also the logits, on the CPU unless the step was all plain greedy (logprobs read them either way)."""
        seqs, rows, drafts = plan.batch.seqs, plan.rows, plan.drafts
        plain = [i for i, c in enumerate(plan.chunks) if c.num_logits and i not in drafts]
        if logits.device.type != "cpu":
            if not drafts and all(seqs[i].constraint is None and plain_greedy(seqs[i].sampling.params) for i in plain):
                # One id per row leaves the GPU instead of (rows, vocab) floats: 39 MB at batch 64 with a
                # 152k vocabulary, plus a CPU argmax over them (~6 ms of a 23 ms step on an H200).
                picked = logits[[rows[i] for i in plain]].argmax(-1).tolist()
                return {i: [token] for i, token in zip(plain, picked, strict=True)}, logits
            logits = logits.cpu()  # the sampler, grammars and speculative acceptance run on the CPU
        for i in plain:
            if (constraint := seqs[i].constraint) is not None:
                constraint.mask(logits[rows[i]])  # in place: only tokens the grammar allows can be drawn
        sampled = sample(logits[[rows[i] for i in plain]], [seqs[i].sampling for i in plain])
        tokens = {i: [token] for i, token in zip(plain, sampled, strict=True)}
        for i in sorted(drafts):
            d = drafts[i]
            tokens[i] = accept(logits[rows[i] : rows[i] + len(d.tokens) + 1], d.tokens, d.probs, seqs[i].sampling)
        return tokens, logits

    def _postprocess(self, plan: StepPlan, logits: torch.Tensor, tokens: dict[int, list[int]]) -> list[RequestOutput]:
        """Append the tokens and turn them into outputs; finished sequences leave, and hooks see their
        requests' outputs (and may end them)."""
        outputs = []
        watched: list[tuple[GenerationHook, RequestOutput]] = []  # outputs of requests with a hook
        for i, (seq, n) in enumerate(zip(plan.batch.seqs, plan.batch.num_new, strict=True)):
            if i not in tokens:
                seq.num_computed += n  # a prefill chunk that has not reached the end of its prompt yet
                self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
                if i in self.runner.hidden:  # a prefill-only request whose prompt is computed: done
                    seq.finish_reason = FinishReason.STOP
                    outputs.append(replace(seq.output([]), hidden=self.runner.hidden[i]))
                    del self._seqs[seq.request_id]
                    self._finish(seq)
                continue
            outputs.append(self._advance(seq, tokens[i], plan.drafts.get(i), logits[plan.rows[i] :]))
            if seq.request.hook is not None:
                watched.append((seq.request.hook, outputs[-1]))
            if seq.finish_reason is not None:
                del self._seqs[seq.request_id]
                self._finish(seq)
        if watched:
            outputs += self._run_hooks(watched)
        if self.speculator is not None:
            self.speculator.prefilled(plan.batch)
        return outputs

    def _advance(self, seq: Sequence, tokens: list[int], draft: Draft | None, logits: torch.Tensor) -> RequestOutput:
        """Append `tokens` to `seq` up to its finish; `logits` from the row its first token was drawn from."""
        appended = []
        for token in tokens:
            seq.append(token, self.max_model_len)
            appended.append(token)
            if seq.finish_reason is not None:
                break
        hook, asked = seq.request.hook, seq.request.params.logprobs
        logprobs: tuple[TokenLogprob, ...] = ()
        if asked is not None or (hook is not None and hook.top_logprobs > 0):  # token j was drawn from row j
            k = max(asked or 0, hook.top_logprobs if hook is not None else 0)
            logprobs = token_logprobs(logits[: len(appended)], appended, k)
        # Every token but the newest now has its KV: after a verification, the last token and the
        # kept drafts; the rejected drafts' positions roll back and their blocks go back.
        seq.num_computed = len(seq.token_ids) - 1
        if draft is not None:
            self.block_manager.truncate(seq.block_table, seq.num_computed)
        self.block_manager.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_computed)
        if self.kv_tier is not None and seq.num_generated == len(appended):  # its prompt just completed
            self.kv_tier.offload(seq)
        if self.window:  # every layer windowed: the next query sees positions > num_computed - window only
            passed = (seq.num_computed - self.window + 1) // self.config.block_size
            self.block_manager.release_before(seq.block_table, passed)
        if draft is not None and self.speculator is not None:
            self.speculator.verified(seq, len(draft.tokens), len(tokens) - 1, len(appended))
        return seq.output(appended, logprobs)

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
        scheduler, budget = self.scheduler, self.kv_budget
        total, used = (budget.total_bytes, budget.used_bytes) if budget else (0, 0)
        return EngineStats(
            QueueStats(waiting=len(scheduler.waiting), running=len(scheduler.running)),
            BlockUse.of(self.block_manager.stats()),
            self.meter.work(scheduler.num_preemptions),
            KVMemory(self.config.block_size, self.cache.nbytes, total, used),
            speculative=self.speculator.stats.as_dict() if self.speculator else {},
            kv_tier=self.kv_tier.stats.as_dict() if self.kv_tier else {},
            kernels=self.kernels,
        )

    @functools.cached_property
    def kernels(self) -> str:
        """Whose kernels run this engine's model (`EngineStats.kernels`)."""
        if self.model.device.type != "cpu":
            return backend_for(self.model.device).name
        from engines.kernels import cpu_kernels

        return cpu_kernels.variant() or "torch"
