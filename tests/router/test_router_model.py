"""The learned router: features, training and its saved form, calibration, RouteLLM metrics, the CLI.

Labels are synthetic (`router_model.synthetic`): long, many-step math and many-requirement code fail
on the small tier, short chat passes, 10% flipped, so a router has something real to learn. MiniLM
is the real one from its registry package.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from core.embedder import Embedder
from gateway.cli import main
from router_model import calibrate, evaluate
from router_model.encoder import Int8Linear, RouterEncoder
from router_model.examples import LabelFileError, ids_hash, load_examples, split_examples
from router_model.features import (
    CHEAP_FEATURES,
    FEATURE_VERSION,
    cheap_features,
    embedding_text,
    featurize,
)
from router_model.model import LARGE, SMALL, RouterLoadError, load_router, read_metadata, save_router, write_metadata
from router_model.synthetic import synthetic_examples, write_label_file
from router_model.train import TrainResult, train_router


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return RouterEncoder()


@pytest.fixture(scope="module")
def trained(embedder: Embedder) -> TrainResult:
    train, heldout = split_examples(synthetic_examples(400, seed=1), test_size=0.25, seed=0)
    return train_router(train, heldout, embedder, seed=0, folds=3)


def _feature(vector: np.ndarray, name: str) -> float:
    return float(vector[CHEAP_FEATURES.index(name)])


def test_int8_encoder_matches_minilm(embedder: Embedder) -> None:
    """Our int8 MiniLM against sentence-transformers' fp32 one (the oracle) on real prompts."""
    texts = [embedding_text(e.messages) for e in synthetic_examples(40, seed=5)]
    texts += ["Hi", "x" * 3000]  # one word piece and past MiniLM's 256-piece limit
    ours = embedder.encode(texts)
    reference = Embedder(cache_size=0).encode(texts)
    cosine = (ours * reference).sum(axis=1)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    assert cosine.min() > 0.97 and np.median(cosine) > 0.99, cosine
    # nearer its own fp32 twin than any other text's: the int8 error is far below what tells texts apart
    assert ((ours @ reference.T).argmax(axis=1) == np.arange(len(texts))).all()

    linear = torch.nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    x[0, 0, 3] = 40.0  # one outlier activation scales only its own token
    quantized, exact = Int8Linear(linear)(x), linear(x)
    assert quantized.shape == exact.shape
    error = (quantized - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert error.max() < 0.03, error


def test_int8_products_are_the_same_integers_with_or_without_vnni() -> None:
    """Without VNNI the codes multiply as floats (fp32, fp64 past 1,040 terms): the same sums as `_int_mm`,
    so a text's features do not depend on the CPU. Both paths run here, whatever this CPU has."""
    from router_model.encoder import EXACT_FP32_K, Int8MiniLM

    torch.manual_seed(0)
    for features in (64, EXACT_FP32_K + 500):  # the fp32 path and the fp64 one
        linear = torch.nn.Linear(features, 48)
        x = torch.randn(9, features) * 3
        x[:, :8] = 1000.0  # near-full-scale codes: the sums are at their largest
        fast, floats = Int8Linear(linear, int_mm=True), Int8Linear(linear, int_mm=False)
        assert floats.codes_t.dtype == (torch.float32 if features <= EXACT_FP32_K else torch.float64)
        assert torch.equal(fast(x), floats(x))
    texts = [embedding_text(e.messages) for e in synthetic_examples(6, seed=2)]
    a, b = (Int8MiniLM(int_mm=flag).encode(texts) for flag in (True, False))
    assert np.array_equal(a, b)


def test_features_are_deterministic_and_versioned(embedder: Embedder) -> None:
    conversations = [e.messages for e in synthetic_examples(24, seed=3)]
    first = featurize(conversations, embedder)
    again = featurize(conversations, RouterEncoder())  # a fresh model and no cache: the same numbers
    assert first.shape == (24, Embedder.DIM + len(CHEAP_FEATURES)) and first.dtype == np.float32
    assert np.array_equal(first, again)
    assert FEATURE_VERSION and len(set(CHEAP_FEATURES)) == len(CHEAP_FEATURES)

    code = [{"role": "user", "content": "Write a Python function.\n```python\ndef f(x):\n    return x\n```"}]
    math_q = [{"role": "user", "content": "Solve: 12 + 30 * 4 = ? Calculate the total step by step, as a JSON list."}]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    c, m, h = cheap_features(code), cheap_features(math_q), cheap_features(chat)
    assert _feature(c, "code_fences") == 1 and _feature(m, "code_fences") == 0
    assert _feature(c, "code_asks") >= 2 and _feature(c, "indented_lines_share") > 0
    assert _feature(m, "operators_per_100_tokens") > _feature(h, "operators_per_100_tokens")
    assert _feature(m, "math_words") >= 2 and _feature(m, "numbers") > 0 and _feature(h, "numbers") == 0
    assert _feature(m, "format_json") == 1 and _feature(m, "format_list") == 1 and _feature(c, "format_json") == 0
    assert _feature(h, "turns") == 4 and _feature(h, "user_turns") == 2 and _feature(h, "has_system") == 1
    assert _feature(h, "question_why") == 1 and _feature(h, "question_marks") == 1
    assert _feature(h, "log_chars_all") > _feature(h, "log_chars_last")
    # the last user turn leads (MiniLM truncates the end); the context follows
    assert embedding_text(chat).startswith("Why is the sky blue?") and "assistant: Hello!" in embedding_text(chat)
    # OpenAI's content parts read as their text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Why is the sky blue?"}]}]
    assert np.array_equal(cheap_features(parts), cheap_features([{"role": "user", "content": "Why is the sky blue?"}]))


def test_router_learns_the_signal(trained: TrainResult) -> None:
    result = evaluate.evaluate_router(trained.heldout_p, trained.heldout)
    assert result.metrics["router"].apgr > 0.65  # random routing recovers 0.5
    assert result.metrics["random"].apgr == pytest.approx(0.5)
    assert result.metrics["router"].cpt50 < 0.35 and result.metrics["router"].cpt80 < 0.6
    assert result.metrics["optimal"].apgr >= result.metrics["router"].apgr
    chosen = trained.router.metadata["classifier"]
    assert chosen == max(trained.scores, key=lambda n: trained.scores[n].cv_apgr)
    assert trained.scores[chosen].heldout_auc > 0.75
    tier, p = trained.router.route([{"role": "user", "content": "Hi! How are you today?"}])
    assert tier == SMALL and p > 0.5


def test_save_load_round_trip_and_version_check(trained: TrainResult, embedder: Embedder, tmp_path: Path) -> None:
    directory = save_router(trained.router, tmp_path / "router")
    loaded = load_router(directory, embedder)
    conversations = [e.messages for e in trained.heldout]
    assert np.array_equal(loaded.p_small_ok(conversations), trained.router.p_small_ok(conversations))
    assert np.array_equal(loaded.p_small_ok(conversations), trained.heldout_p)
    for messages in conversations[:5]:
        assert loaded.route(messages) == trained.router.route(messages)
    assert loaded.route(conversations[0], threshold=1.0)[0] == LARGE
    assert loaded.route(conversations[0], threshold=0.0)[0] == SMALL

    meta = read_metadata(directory)
    assert meta["feature_version"] == FEATURE_VERSION and meta["classifier"] in meta["metrics"]
    train_ids = set(meta["train_ids"])
    assert meta["train_ids_hash"] == ids_hash([e for e in synthetic_examples(400, seed=1) if e.id in train_ids])
    assert not train_ids & {e.id for e in trained.heldout}
    assert {"created", "metrics", "threshold", "n_train", "n_heldout"} <= meta.keys()

    write_metadata(meta | {"feature_version": "minilm-l6+cheap-0"}, directory)
    with pytest.raises(RouterLoadError, match=r"'minilm-l6\+cheap-0'.*retrain"):
        load_router(directory)
    write_metadata(meta, directory)
    (directory / "router.joblib").write_bytes(b"not the model")
    with pytest.raises(RouterLoadError, match="not the model"):
        load_router(directory)
    with pytest.raises(RouterLoadError, match="no router"):
        load_router(tmp_path / "nowhere")


def test_calibration_hits_the_requested_share_on_held_out_prompts(trained: TrainResult) -> None:
    """Traffic: requests drawn from 300 prompts the router never saw (embedding thousands of distinct ones
    would take minutes here). A threshold calibrated on one window of 20,000 requests meets the share
    on the next window; at these sizes sampling moves the share by about 0.4 points."""
    router = trained.router
    pool = synthetic_examples(300, seed=7)
    p_pool = router.p_small_ok([e.messages for e in pool])
    rng = np.random.default_rng(0)

    def traffic(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return p[rng.integers(0, len(p), 20_000)], p[rng.integers(0, len(p), 20_000)]

    calibration, fresh = traffic(p_pool)
    for share in (0.1, 0.25, 0.5):
        threshold = calibrate.threshold_for_share(calibration, share)
        assert abs(calibrate.large_share(fresh, threshold) - share) <= 0.02, share
    global_t = calibrate.threshold_for_share(calibration, 0.25)

    # A tenant that asks only math: the global threshold sends far more of it large than asked; its own
    # threshold, from its own logged prompts, meets the share on its next ones.
    math_p = p_pool[[e.source == "gsm8k" for e in pool]]
    logged, later = traffic(math_p)
    assert calibrate.large_share(later, global_t) > 0.35
    tenant_t = calibrate.threshold_for_share(logged, 0.25)
    assert abs(calibrate.large_share(later, tenant_t) - 0.25) <= 0.02

    # the conversation-level entry points: per tenant, too few prompts keep the global threshold
    math_conversations = [e.messages for e in pool if e.source == "gsm8k"]
    by_tenant = {"mathy": math_conversations, "quiet": math_conversations[:10]}
    tenants = calibrate.calibrate_tenants(router, by_tenant, 0.25, min_prompts=50)
    assert set(tenants) == {"mathy"}
    assert (
        tenants["mathy"]
        == calibrate.threshold_for_share(math_p, 0.25)
        != calibrate.calibrate(router, [e.messages for e in pool], 0.25)
    )
    router.metadata["tenant_thresholds"] = tenants
    assert router.threshold_for("mathy") == tenants["mathy"] and router.threshold_for("other") == router.threshold


def test_threshold_for_share_handles_ties_and_ends() -> None:
    p = np.array([0.1, 0.2, 0.2, 0.2, 0.2, 0.6, 0.7, 0.8, 0.9, 0.95])
    assert calibrate.large_share(p, calibrate.threshold_for_share(p, 0.0)) == 0.0
    assert calibrate.large_share(p, calibrate.threshold_for_share(p, 1.0)) == 1.0
    assert calibrate.threshold_for_share(p, 0.5) == pytest.approx(0.4)  # between 0.2 and 0.6
    # 0.3 would split the tie at 0.2: the nearest reachable share is 0.1 or 0.5; 0.1 is nearer
    assert calibrate.large_share(p, calibrate.threshold_for_share(p, 0.3)) == 0.1
    with pytest.raises(ValueError):
        calibrate.threshold_for_share(p, 1.5)


def test_quality_floor_takes_the_fewest_large_calls_that_keep_it() -> None:
    rng = np.random.default_rng(0)
    p = rng.random(200)
    small = rng.random(200) < p  # the score carries signal
    large = rng.random(200) < 0.9
    for floor in (0.6, 0.75, 0.85):
        t = calibrate.threshold_for_quality_floor(p, small, large, floor)
        quality = lambda t: np.mean(np.where(p < t, large, small))  # noqa: E731
        assert quality(t) >= floor
        # brute force over every threshold: none with fewer large calls keeps the floor
        fewer = [u for u in np.concatenate([[0.0], p]) if np.mean(p < u) < np.mean(p < t)]
        assert all(quality(u) < floor for u in fewer)


def test_apgr_and_cpt_on_hand_computed_examples() -> None:
    small = np.array([1, 1, 0, 0], bool)
    large = np.array([1, 1, 1, 1], bool)
    # perfect: the two small failures go large first. PGR at 0, 1/4, ..., 1: 0, .5, 1, 1, 1
    perfect = evaluate.evaluate_scores({"r": np.array([0.9, 0.8, 0.2, 0.1])}, small, large).metrics["r"]
    assert perfect.apgr == pytest.approx(0.25 * (0.25 + 0.75 + 1 + 1))  # 0.75
    assert perfect.cpt50 == pytest.approx(0.25) and perfect.cpt80 == pytest.approx(0.25 + 0.6 * 0.25)
    # backwards: the two that small answers go large first. PGR: 0, 0, 0, .5, 1
    worst = evaluate.evaluate_scores({"r": np.array([0.1, 0.2, 0.8, 0.9])}, small, large).metrics["r"]
    assert worst.apgr == pytest.approx(0.25 * (0.25 + 0.75))  # 0.25
    assert worst.cpt50 == pytest.approx(0.75) and worst.cpt80 == pytest.approx(0.9)
    # a constant score cannot choose: its curve is random routing's line
    flat = evaluate.evaluate_scores({"r": np.full(4, 0.5)}, small, large).metrics
    assert flat["r"].apgr == pytest.approx(0.5) == flat["random"].apgr
    assert flat["random"].cpt50 == pytest.approx(0.5) and flat["random"].cpt80 == pytest.approx(0.8)
    assert flat["optimal"].apgr == pytest.approx(perfect.apgr)

    # a perfect router where small fails on 5 of 100: PGR 1 from 5% of calls on, APGR near 1
    small100 = np.arange(100) >= 5
    near_one = evaluate.evaluate_scores({"r": np.arange(100.0)}, small100, np.ones(100, bool)).metrics["r"]
    assert near_one.apgr == pytest.approx(1 - 0.05 / 2) and near_one.cpt80 == pytest.approx(0.04)
    # tiers that tie leave PGR undefined
    tied = evaluate.evaluate_scores({"r": np.arange(4.0)}, large, large).metrics["r"]
    assert math.isnan(tied.apgr) and math.isnan(tied.cpt50)


def test_quality_curve_matches_routing_at_every_threshold() -> None:
    rng = np.random.default_rng(1)
    scores = np.round(rng.random(300), 2)  # ties
    small, large = rng.random(300) < 0.5, rng.random(300) < 0.8
    curve = evaluate.quality_curve(scores, small, large)
    for t in np.concatenate([np.unique(scores), [1.01]]):
        go_large = scores < t
        i = int(np.flatnonzero(np.isclose(curve.shares, go_large.mean()))[0])
        assert curve.quality[i] == pytest.approx(np.mean(np.where(go_large, large, small)))
    assert len(curve.shares) == len(np.unique(scores)) + 1


def test_length_baseline_and_the_plot(tmp_path: Path) -> None:
    examples = synthetic_examples(200, seed=4, sources=("gsm8k",))  # long problems fail on small
    result = evaluate.evaluate_router(np.full(200, 0.5), examples)
    assert result.metrics["length"].apgr > 0.6 and result.metrics["router"].apgr == pytest.approx(0.5)
    path = evaluate.plot_curves(result, tmp_path / "plots" / "curves.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_split_is_seeded_and_stratified_by_source(tmp_path: Path) -> None:
    examples = synthetic_examples(400, seed=5)
    train, held = split_examples(examples, 0.25, seed=3)
    assert len(held) == 100 and not {e.id for e in train} & {e.id for e in held}
    assert {s: sum(e.source == s for e in held) for s in ("gsm8k", "chat")} == {"gsm8k": 25, "chat": 25}
    assert split_examples(list(reversed(examples)), 0.25, seed=3) == (train, held)  # order does not matter
    assert split_examples(examples, 0.25, seed=4)[1] != held

    labels = tmp_path / "labels.jsonl"
    write_label_file(examples[:3], labels)
    assert [e.id for e in load_examples(labels)] == sorted(e.id for e in examples[:3])
    labels.write_text(labels.read_text() + '{"id": "x/0", "sou')  # a labeling run mid-write
    assert len(load_examples(labels)) == 3
    labels.write_text(labels.read_text() + 'rce": "x"}\n{"id": "x/1", "source": "x"}\n')
    with pytest.raises(LabelFileError, match=r"row 4: missing small_ok, large_ok"):
        load_examples(labels)


def test_cli_train_calibrate_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    labels = write_label_file(synthetic_examples(160, seed=6), tmp_path / "labels.jsonl")
    directory = tmp_path / "router"
    train = ["router", "train", "--labels", str(labels), "--router", str(directory), "--folds", "2", "--no-hidden"]
    assert main(train) == 0
    out = capsys.readouterr().out
    assert "<- kept" in out and "router " in out and str(directory) in out
    meta = read_metadata(directory)
    assert meta["label_file"] == str(labels.resolve()) and meta["n_heldout"] == 32

    assert main(["router", "calibrate", "--router", str(directory), "--large-share", "0.3"]) == 0
    printed = capsys.readouterr().out
    share = float(printed.split("large share ")[1].split()[0])
    assert abs(share - 0.3) <= 1 / 32 and "on 32 prompts, quality" in printed
    meta = read_metadata(directory)
    assert meta["threshold_from"].startswith("large share 0.3 of 32 prompts")
    prompts = tmp_path / "tenant.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": e.messages}) + "\n" for e in synthetic_examples(120, seed=9, sources=("chat",)))
    )
    assert main(["router", "calibrate", "--router", str(directory), "--large-share", "0.2", "--prompts",
                 str(prompts), "--tenant", "acme"]) == 0  # fmt: skip
    assert "acme" in read_metadata(directory)["tenant_thresholds"]
    assert read_metadata(directory)["threshold"] == meta["threshold"]  # the global one stays

    plot = tmp_path / "eval.png"
    capsys.readouterr()
    assert main(["router", "eval", "--router", str(directory), "--plot", str(plot), "--json"]) == 0
    out = capsys.readouterr().out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    metrics = json.loads(out.strip().splitlines()[-1])
    assert metrics["n_heldout"] == 32 and metrics["apgr_random"] == 0.5 and metrics["apgr"] is not None
    assert "at threshold" in out

    write_metadata(meta | {"feature_version": "old"}, directory)
    assert main(["router", "eval", "--router", str(directory)]) == 1
    assert "retrain" in capsys.readouterr().err
