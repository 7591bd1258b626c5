"""Speculative decoding: lossless against plain decoding, and no KV left behind by rejected drafts.

Oracles: plain greedy decoding of the same engine for greedy output; the exact target distribution
of a tiny Markov chain, against which a plain sampler's error is the yardstick, for sampling.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engines.checkpoints.loader import load_model
from engines.engine import Engine, EngineConfig
from engines.request import EngineRequest, RequestOutput
from engines.sampling import SamplingParams, SamplingState, distribution
from engines.speculative.acceptance import LinearCost, accept, choose_k, expected_tokens
from engines.speculative.proposers import NgramProposer
from engines.speculative.speculator import SpeculativeConfig
from tiny import tiny_hf_model

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_hf_model("qwen2", tmp_path_factory.mktemp("tiny_qwen"))


def run(engine: Engine, requests: list[EngineRequest], check: bool = False) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        outputs: list[RequestOutput] = engine.step()
        for o in outputs:
            out[o.request_id] += o.new_token_ids
        if check:
            assert_blocks_match_computed(engine)
    return out


def assert_blocks_match_computed(engine: Engine) -> None:
    """Every running sequence holds exactly the blocks its computed tokens need: rejected drafts'
    positions gave theirs back (in the target and in the draft's own pool)."""
    bs = engine.config.block_size
    for seq in engine.scheduler.running:
        assert len(seq.block_table.block_ids) == -(-seq.num_computed // bs), seq.request_id
    proposer = engine.speculator.proposer if engine.speculator else None
    for state in getattr(proposer, "states", {}).values():
        assert len(state.table.block_ids) == -(-state.num_computed // bs)


def requests(temperature: float = 0.0, max_tokens: int = 40, **kw: object) -> list[EngineRequest]:
    return [
        EngineRequest(
            f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=i, **kw)
        )
        for i, p in enumerate(PROMPTS)
    ]


def spec_engine(model_dir: Path, method: str, **kw: object) -> Engine:
    cfg = EngineConfig(block_size=4, kv_cache_bytes=1 << 22, speculative=SpeculativeConfig(method=method, **kw))
    return Engine.from_dir(model_dir, dtype="fp32", config=cfg, draft_dir=model_dir if method == "draft" else None)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_speculative_greedy_is_plain_greedy(
    tiny_dir: Path, method: str, adaptive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = run(Engine.from_dir(tiny_dir, dtype="fp32"), requests())
    engine = spec_engine(tiny_dir, method, adaptive=adaptive)
    if adaptive:  # costs as on a CPU where a step is bound by reading weights: verified rows are cheap
        assert engine.speculator is not None
        monkeypatch.setattr(engine.speculator, "_costs", lambda *_: (1.0, 0.02, 0.05 if method == "draft" else 0.0))
    assert run(engine, requests(), check=True) == plain
    stats = engine.stats().speculative
    assert stats["spec_proposed"] > 0 and stats["spec_accepted"] > 0
    if method == "draft":  # the draft is the target: every draft is the target's own argmax
        assert stats["spec_acceptance_rate"] == 1.0
    if adaptive and method == "draft":  # all accepted: the rate climbs and k with it
        assert max(engine.speculator.stats.by_k) == 4


def test_adaptive_k_stops_drafting_when_rows_cost_as_much_as_steps(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = spec_engine(tiny_dir, "draft", adaptive=True)
    assert engine.speculator is not None
    monkeypatch.setattr(engine.speculator, "_costs", lambda *_: (1.0, 0.9, 0.9))
    run(engine, requests(), check=True)
    assert engine.stats().speculative["spec_proposed"] == 0
    assert not engine.speculator.proposer.states  # and the draft never computed a prompt


def test_a_draft_head_cut_to_frequent_tokens_stays_lossless(tiny_dir: Path) -> None:
    plain = run(Engine.from_dir(tiny_dir, dtype="fp32"), requests())
    engine = spec_engine(tiny_dir, "draft", adaptive=False, draft_vocab=160)
    assert engine.speculator is not None
    vocab = engine.speculator.proposer.runner.vocab
    assert vocab is not None and 160 <= len(vocab) < 320 and 0 in vocab.tolist()  # eos always in
    assert run(engine, requests(), check=True) == plain
    stats = engine.stats().speculative
    assert 0 < stats["spec_acceptance_rate"] < 1.0  # the target's own picks above id 160 are refused
    run(engine, requests(temperature=0.8), check=True)  # a draft distribution with zeros: still runs


def test_draft_equal_to_target_accepts_everything_when_sampling(tiny_dir: Path) -> None:
    engine = spec_engine(tiny_dir, "draft", adaptive=False)
    out = run(engine, requests(temperature=0.9, top_p=0.95, top_k=50), check=True)
    assert all(len(tokens) == 40 for tokens in out.values())
    stats = engine.stats().speculative
    assert stats["spec_proposed"] > 100 and stats["spec_acceptance_rate"] == 1.0


def test_rollback_leaks_no_blocks_across_a_mixed_batch(tiny_dir: Path) -> None:
    """Decodes that draft, requests that cannot (penalties), a long prompt prefilled in chunks, early
    stops and an abort, in one engine with a small pool: blocks always match what is computed, and
    every block comes back in the end."""
    cfg = EngineConfig(
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=24,
        speculative=SpeculativeConfig(method="draft", adaptive=False, draft_kv_cache_bytes=1 << 19),
    )
    engine = Engine(
        load_model(tiny_dir, "fp32"), Engine.from_dir(tiny_dir).tokenizer, cfg, draft_model=load_model(tiny_dir, "fp32")
    )
    draft_model = load_model(tiny_dir, "fp32")
    torch.manual_seed(1)
    with torch.no_grad():  # a different draft, so some drafts are rejected
        for p in draft_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    target = Engine.from_dir(tiny_dir, dtype="fp32")
    engine = Engine(target.model, target.tokenizer, cfg, draft_model=draft_model)
    reqs = requests(max_tokens=30)
    reqs[1] = EngineRequest("r1", PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.0, presence_penalty=0.5))
    reqs[2] = EngineRequest("r2", list(range(1, 90)), SamplingParams(max_tokens=20, temperature=0.7, seed=3))
    reqs[3] = EngineRequest("r3", PROMPTS[3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for r in reqs:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        assert_blocks_match_computed(engine)
        steps += 1
        if steps == 3:
            engine.abort("r5")
    stats = engine.stats()
    assert stats.speculative["spec_proposed"] > stats.speculative["spec_accepted"] > 0  # some were rejected
    assert stats.kv_blocks_used == 0
    assert engine.speculator.proposer.block_manager.stats().used == 0
    assert not engine.speculator.proposer.states


def test_ngram_lookup() -> None:
    ngram = NgramProposer(max_n=3, min_n=2)
    assert ngram.lookup([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # "2 3" was followed by "4 5"
    assert ngram.lookup([1, 2, 3, 4, 2, 3, 7, 8, 2, 3], 3) == [7, 8, 2]  # the latest match wins
    assert ngram.lookup([5, 6, 7, 5, 6], 4) == [7, 5, 6]  # the continuation runs into the suffix itself
    assert ngram.lookup([1, 2, 3, 4], 3) == []


def test_adaptive_k_turns_drafting_off_when_it_does_not_pay() -> None:
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 3) == 4.0
    # Cheap rows and high acceptance: draft the most; costly rows or low acceptance: none.
    assert choose_k(0.9, 5, base_cost=1.0, row_cost=0.02, draft_row_cost=0.0, probe=False) == 5
    assert choose_k(0.2, 5, base_cost=1.0, row_cost=0.3, draft_row_cost=0.3, probe=False) == 0
    assert choose_k(0.2, 5, base_cost=1.0, row_cost=0.3, draft_row_cost=0.3, probe=True) == 1
    # A predicted 7% gain (one draft at α = 0.5 for half a step's cost: 1.5 tokens per 1.4) drafts with
    # no margin and not with the default 10% one.
    assert choose_k(0.5, 1, base_cost=1.0, row_cost=0.2, draft_row_cost=0.2, probe=False) == 1
    assert choose_k(0.5, 1, base_cost=1.0, row_cost=0.2, draft_row_cost=0.2, probe=False, min_gain=0.1) == 0
    cost = LinearCost(per_token_share=0.1)
    for n in (1, 4, 8, 2, 6):
        cost.add(n, 0.05 + 0.01 * n)
    fixed, per_token = cost.coefficients()
    assert fixed == pytest.approx(0.05) and per_token == pytest.approx(0.01)


# --- the rejection sampler reproduces the target distribution ---------------------------------------

V = 5
TARGET = torch.randn(V, V, generator=torch.Generator().manual_seed(11)) * 1.5  # logits of token t given t-1
DRAFT = TARGET + torch.randn(V, V, generator=torch.Generator().manual_seed(12)) * 1.5  # a rough guess of it
STEPS = 3  # tokens generated per sample; k = 2 drafts, so the bonus token is exercised too


def exact_joint(params: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3 | x0 = 0) under the target sampler: what every correct sampler must reproduce."""
    p = distribution(TARGET, params).double()
    p = p / p.sum(-1, keepdim=True)
    joint = torch.zeros([V] * STEPS, dtype=torch.float64)
    for xs in itertools.product(range(V), repeat=STEPS):
        prev, prob = 0, 1.0
        for x in xs:
            prob *= float(p[prev, x])
            prev = x
        joint[xs] = prob
    return joint


def speculative_sample(state: SamplingState, draft_logits: torch.Tensor | None, always_accept: bool = False) -> tuple:
    """STEPS tokens from x0 = 0 by drafting 2 tokens and verifying, as the engine does."""
    params = state.params
    out = [0]
    while len(out) <= STEPS:
        drafts, qs = [], []
        prev = out[-1]
        for _ in range(2):
            if draft_logits is None:  # point-mass proposer: a fixed guess, like an n-gram lookup
                token = (prev + 1) % V
            else:
                q = distribution(draft_logits[prev], params)
                token = int(torch.multinomial(q, 1, generator=state.generator))
                qs.append(q)
            drafts.append(token)
            prev = token
        context = [out[-1], *drafts]
        target_logits = TARGET[context]  # rows: after the last token, after each draft
        if always_accept:
            out += drafts
            continue
        out += accept(target_logits, drafts, torch.stack(qs) if qs else None, state)
    return tuple(out[1 : STEPS + 1])


def plain_sample(state: SamplingState) -> tuple:
    out = [0]
    for _ in range(STEPS):
        out.append(int(torch.multinomial(distribution(TARGET[out[-1]], state.params), 1, generator=state.generator)))
    return tuple(out[1:])


def l2_to(joint: torch.Tensor, samples: list[tuple]) -> float:
    counts = torch.zeros_like(joint)
    for s in samples:
        counts[s] += 1
    return float((counts / len(samples) - joint).norm())


@pytest.mark.parametrize(
    ("params", "proposer"),
    [
        (SamplingParams(temperature=1.0), "draft"),
        (SamplingParams(temperature=0.7, top_k=3, top_p=0.9), "draft"),
        (SamplingParams(temperature=1.0), "point"),
    ],
)
def test_speculative_sampling_reproduces_the_target_distribution(params: SamplingParams, proposer: str) -> None:
    joint = exact_joint(params)
    draft = DRAFT if proposer == "draft" else None
    spec_state = SamplingState(SamplingParams(**{**params.__dict__, "seed": 1}))
    plain_state = SamplingState(SamplingParams(**{**params.__dict__, "seed": 2}))
    spec = [speculative_sample(spec_state, draft) for _ in range(8000)]
    plain = [plain_sample(plain_state) for _ in range(8000)]
    spec_err = [l2_to(joint, spec[:n]) for n in (500, 2000, 8000)]
    plain_err = [l2_to(joint, plain[:n]) for n in (500, 2000, 8000)]
    # Monte-Carlo error falls like 1/√n: 4x the samples halves it. Speculative sampling must keep up
    # with a plain sampler of the target at every size (a biased sampler stalls at its bias).
    for s, p in zip(spec_err, plain_err, strict=True):
        assert s < 1.6 * p + 0.004, (spec_err, plain_err)
    assert spec_err[-1] < 0.6 * spec_err[0] + 0.004
    # The check can fail: keeping every draft unverified is a different distribution.
    biased = [
        speculative_sample(SamplingState(SamplingParams(**{**params.__dict__, "seed": 3})), draft, True)
        for _ in range(8000)
    ]
    assert l2_to(joint, biased) > 3 * plain_err[-1]


def test_the_guard_stops_drafting_at_a_batch_size_where_it_measured_slower() -> None:
    from engines.speculative.guard import CHECK_STEPS, EXPLORE_EVERY, MAX_EXPLORE_EVERY, MIN_SAMPLES, SpeedGuard

    guard = SpeedGuard()
    # At first: drafting, with a plain step in 4 until plain has MIN_SAMPLES measurements.
    assert [guard.allow(8) for _ in range(8)] == [True, True, True, False] * 2
    guard.observe(8, 2, 2.0, drafted=True)  # a draft catching up on its prompt: one slow step...
    for _ in range(MIN_SAMPLES):
        guard.observe(8, 8, 0.1, drafted=False)  # plain: 80 tok/s
    for _ in range(MIN_SAMPLES - 1):
        guard.observe(8, 12, 0.1, drafted=True)  # ...then 120 tok/s: judged on the average, still slower
    # slower: plain, but for checks of two drafting steps in a row (the first catches a lagging draft up,
    # the second is measured), each wait twice the last up to MAX_EXPLORE_EVERY while drafting stays slower
    allowed = [guard.allow(8) for _ in range(1200)]
    starts = [i for i, a in enumerate(allowed) if a and (i == 0 or not allowed[i - 1])]
    assert sum(allowed) == CHECK_STEPS * len(starts) and all(allowed[i + 1] for i in starts)
    assert starts[0] == EXPLORE_EVERY
    assert [b - a for a, b in itertools.pairwise(starts)] == [32, 64, 128, 256, 256, 256]
    assert MAX_EXPLORE_EVERY == 256
    for _ in range(8):  # drafting measured faster now: it comes back
        guard.observe(8, 16, 0.1, drafted=True)
    assert sum(guard.allow(9) for _ in range(EXPLORE_EVERY)) == EXPLORE_EVERY - 1  # 9 shares 8's bucket
    assert guard.allow(1)  # another batch size is measured on its own, drafting first
    assert set(guard.rates()) == {1, 4}
    plain, drafting = guard.rates()[4]
    assert plain == pytest.approx(80) and drafting > plain


def test_speculation_keeps_plain_greedy_output_while_the_guard_switches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain and drafting steps interleave under the guard (plain first, then drafting, one plain step
    in 16); the text stays plain greedy decoding's, and both kinds of step are measured."""
    model_dir = tiny_hf_model("llama", tmp_path)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]]
    plain = Engine.from_dir(model_dir, dtype="fp32")
    spec = spec_engine(model_dir, "ngram")
    assert spec.speculator is not None
    monkeypatch.setattr(spec.speculator, "_costs", lambda *_: (1.0, 0.02, 0.0))  # drafting predicted to pay
    outs = []
    for engine in (plain, spec):
        for i, p in enumerate(prompts):
            engine.add_request(EngineRequest(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0.0)))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
        outs.append(got)
    assert outs[0] == outs[1]
    plain_rate, drafting_rate = spec.speculator.guard.rates()[2]
    assert plain_rate > 0 and drafting_rate > 0
    assert spec.speculator.stats.steps > 0
