"""Verifiers in the engine's step loop (SmolLM2-135M, fp32): logprobs against HF transformers, a loop
stopped early, pruned choices freeing their KV blocks, speculative steps giving the same logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from engines.engine import Engine, EngineConfig
from engines.request import EngineRequest, FinishReason, RequestOutput
from engines.sampling import SamplingParams
from engines.speculative.speculator import SpeculativeConfig
from verifiers.base import Action, Context, Trace, TraceVerifier, Verdict
from verifiers.degeneration import Degeneration
from verifiers.hook import VerifierHook

LOOP_PROMPT = "the the the the the the the the the the the the"


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> Engine:
    return Engine.from_dir(smollm2_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=64 << 20))


def drain(engine: Engine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def run(engine: Engine, prompt: list[int], params: SamplingParams, hook: VerifierHook | None, n: int = 1) -> dict:
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(EngineRequest(rid, prompt, params, hook=hook))
    return drain(engine)


def hook_for(verifier: TraceVerifier, n: int = 1) -> VerifierHook:
    return VerifierHook(verifier, Context(prompt=LOOP_PROMPT), [f"r{i}" for i in range(n)])


class LogprobsOnly(TraceVerifier):
    name, every, top_logprobs = "logprobs", 0, 5

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        return self.verdict(Action.CONTINUE, 1.0, "")


class PruneChoice(TraceVerifier):
    """Prunes one choice once it has `after` tokens."""

    name = "prune-one"

    def __init__(self, index: int, after: int) -> None:
        self.index, self.every = index, after

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        if trace.index == self.index:
            return self.verdict(Action.PRUNE, 0.0, "test")
        return self.verdict(Action.CONTINUE, 1.0, "")


def used_blocks(engine: Engine) -> int:
    return engine.block_manager.stats().used


def test_logprobs_match_transformers(engine: Engine, smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Name the capital of France."}])
    outs = run(engine, prompt, SamplingParams(max_tokens=12, temperature=0.0), hook_for(LogprobsOnly()))["r0"]
    logprobs = [lp for o in outs for lp in o.logprobs]
    generated = [t for o in outs for t in o.new_token_ids]
    assert [lp.token_id for lp in logprobs] == generated and len(generated) > 3
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1)
    for j, lp in enumerate(logprobs):
        assert lp.top[0][0] == lp.token_id  # greedy: the chosen token is the most likely
        assert len(lp.top) == 5 and all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
        assert lp.logprob == pytest.approx(float(expected[j, lp.token_id]), abs=2e-3)
        top_ids = expected[j].topk(5).indices.tolist()
        assert [t for t, _ in lp.top][:3] == top_ids[:3]
    assert used_blocks(engine) == 0


def test_a_forced_loop_is_stopped_early_and_frees_its_blocks(engine: Engine) -> None:
    prompt = engine.tokenizer.encode(LOOP_PROMPT)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    plain = run(engine, prompt, params, None)["r0"]
    assert plain[-1].finish_reason is FinishReason.LENGTH and plain[-1].completion_tokens == 200  # it does loop
    hook = hook_for(Degeneration(every=8, min_tokens=24))
    outs = run(engine, prompt, params, hook)["r0"]
    last = outs[-1]
    assert last.finish_reason is FinishReason.STOP and last.completion_tokens <= 48
    assert [t for o in outs for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids][
        : last.completion_tokens
    ]
    assert hook.summary()[0]["action"] == "stop" and hook.summary()[0]["verifier"] == "degeneration"
    assert used_blocks(engine) == 0


def test_pruned_choices_end_and_free_their_blocks_while_others_go_on(engine: Engine) -> None:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Write a long story about a cat."}])
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    hook = hook_for(PruneChoice(index=1, after=8), n=3)
    seen_used: list[int] = []
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", prompt, params, hook=hook))
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
            if o.request_id == "r1" and o.finish_reason is not None:
                seen_used.append(used_blocks(engine))
        if "r1" in outs and outs["r1"][-1].finish_reason is not None and len(seen_used) == 1:
            seen_used.append(used_blocks(engine))
    assert outs["r1"][-1].finish_reason is FinishReason.PRUNED and outs["r1"][-1].completion_tokens < 12
    assert all(outs[r][-1].finish_reason is FinishReason.LENGTH for r in ("r0", "r2"))
    assert all(outs[r][-1].completion_tokens == 40 for r in ("r0", "r2"))
    assert [a["choice"] for a in hook.summary()] == [1]
    assert used_blocks(engine) == 0


def test_speculative_steps_report_the_same_logprobs(smollm2_dir: Path, engine: Engine) -> None:
    spec = Engine.from_dir(
        smollm2_dir,
        dtype="fp32",
        config=EngineConfig(kv_cache_bytes=64 << 20, speculative=SpeculativeConfig(method="ngram", adaptive=False)),
    )
    prompt = engine.tokenizer.encode(LOOP_PROMPT)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def logprobs(e: Engine) -> Sequence:
        outs = run(e, prompt, params, hook_for(LogprobsOnly()))["r0"]
        return [lp for o in outs for lp in o.logprobs]

    plain, drafted = logprobs(engine), logprobs(spec)
    assert spec.stats().speculative["spec_accepted"] > 0  # some steps did verify drafts
    assert [lp.token_id for lp in drafted] == [lp.token_id for lp in plain]
    for a, b in zip(plain, drafted, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
