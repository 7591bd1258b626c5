"""The router's hidden-state feature and three tiers: training keeps hidden-state classifiers only when
they beat text out of fold, P(tiny_ok) is learned from labels that have it, the cheapest tier meeting the
floor is picked, a tiered router survives saving, and the bootstrap interval behaves."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from core.embedder import Embedder
from router_model.encoder import RouterEncoder
from router_model.evaluate import apgr, bootstrap_apgr, quality_curve
from router_model.examples import Example, split_examples
from router_model.hidden import HiddenSpec
from router_model.model import LARGE, SMALL, Router, cheapest_tier, load_router, save_router
from router_model.synthetic import synthetic_examples
from router_model.train import HiddenData, train_router

FAST = ("logistic_pca",)  # one text candidate: these tests are about the hidden state and the tiers
SPEC = HiddenSpec("small", "test-model", 3, 64)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return RouterEncoder()


def with_tiny(examples: list[Example], seed: int = 0) -> list[Example]:
    """tiny_ok: right only where small is, and then on half of the prompts (those with an even id hash)."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(e, tiny_ok=bool(e.small_ok and rng.random() < 0.5)) for e in examples]


def states(examples: list[Example], informative: bool, seed: int = 0) -> np.ndarray:
    """64-dim "hidden states": the first dimension carries small_ok (and tiny_ok) when informative."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(len(examples), SPEC.dim)).astype(np.float32)
    if informative:
        x[:, 0] += 3.0 * np.array([e.small_ok for e in examples])
        x[:, 1] += 3.0 * np.array([bool(e.tiny_ok) for e in examples])
    return x


def split(n: int = 400) -> tuple[list[Example], list[Example]]:
    return split_examples(with_tiny(synthetic_examples(n, seed=3)), 0.3, seed=0)


def test_an_informative_hidden_state_wins_and_a_useless_one_loses(embedder: Embedder) -> None:
    train, held = split()
    good = train_router(
        train, held, embedder, candidates=FAST, hidden=HiddenData(SPEC, states(train, True), states(held, True, 1))
    )
    meta = good.router.metadata
    assert meta["features"] == "hidden" and meta["hidden"] == SPEC.as_dict()
    assert good.router.hidden_spec == SPEC and meta["classifier"].startswith("hidden_")
    assert meta["text_classifier"] in good.scores and not meta["text_classifier"].startswith("hidden_")
    assert meta["heldout_eval"]["apgr"] > meta["heldout_eval_text"]["apgr"]
    lo, hi = meta["apgr_ci"]
    assert lo <= meta["heldout_eval"]["apgr"] <= hi
    gain = meta["heldout_eval"]["apgr"] - meta["heldout_eval_text"]["apgr"]
    assert meta["apgr_gain_ci"][0] <= gain <= meta["apgr_gain_ci"][1]  # paired: the same resamples for both
    bad = train_router(
        train, held, embedder, candidates=FAST, hidden=HiddenData(SPEC, states(train, False), states(held, False, 1))
    )
    assert bad.router.metadata["features"] == "text" and bad.router.hidden_classifier is None
    assert bad.router.hidden_spec is None


def test_tiny_tier_is_learned_and_used_from_the_hidden_state(embedder: Embedder) -> None:
    train, held = split()
    result = train_router(
        train, held, embedder, candidates=FAST, hidden=HiddenData(SPEC, states(train, True), states(held, True, 1))
    )
    router = result.router
    assert set(router.cheaper) == {"tiny"} and router.metadata["tiers"]["tiny"]["cv_auc_hidden"] > 0.9
    x = states(held, True, 1)
    tiny_p = np.array([router.p_ok(e.messages, x[i])["tiny"] for i, e in enumerate(held)])
    tiny_ok = np.array([bool(e.tiny_ok) for e in held])
    assert tiny_p[tiny_ok].mean() > tiny_p[~tiny_ok].mean() + 0.3
    text_only = router.p_ok(held[0].messages)  # no state: both predictions come from text
    assert set(text_only) == {SMALL, "tiny"} and all(0 < p < 1 for p in text_only.values())


def test_a_floor_with_tiny_on_the_ladder_counts_the_tiny_answers(embedder: Embedder) -> None:
    """With tiny on the ladder the floor's threshold routes the held-out curve as `cheapest_tier` does, tiny
    verdicts included: the quality it keeps is measured on tiny's answers too, and it is the cheapest
    threshold that keeps it (the next lower candidate does not)."""
    train, held = split()
    router = train_router(train, held, embedder, candidates=FAST).router
    curve = router.metadata["heldout_curve"]
    assert len(curve["p_tiny"]) == len(curve["tiny_ok"]) == len(held)
    p, p_tiny = np.asarray(curve["p"]), np.asarray(curve["p_tiny"])
    ok = {SMALL: np.asarray(curve["small_ok"]), LARGE: np.asarray(curve["large_ok"]),
          "tiny": np.asarray([bool(v) for v in curve["tiny_ok"]])}  # fmt: skip

    def routed(t: float) -> tuple[float, float]:
        tiers = [
            cheapest_tier({"tiny": pt, SMALL: ps}, t, ["tiny", SMALL, LARGE]) for pt, ps in zip(p_tiny, p, strict=True)
        ]
        quality = np.mean([ok[tier][i] for i, tier in enumerate(tiers)])
        return float(quality), float(np.mean([tier == LARGE for tier in tiers]))

    for ratio in (0.8, 0.9, 0.95):
        found = router.threshold_for_floor(ratio, tiny=True)
        assert found is not None
        threshold, share = found
        quality, large = routed(threshold)
        assert large == pytest.approx(share)
        if quality < ratio * ok[LARGE].mean() - 1e-9:  # unreachable: then the best quality there is
            assert all(routed(t)[0] <= quality + 1e-9 for t in np.linspace(0, 1, 51))
            continue
        lower = max([x for x in np.concatenate([p, p_tiny]) if x < threshold], default=None)
        if lower is not None:  # one candidate cheaper: the floor is no longer kept
            assert routed(lower)[0] < ratio * ok[LARGE].mean() - 1e-12


def test_no_tiny_labels_no_tiny_prediction(embedder: Embedder) -> None:
    train, held = split_examples(synthetic_examples(300, seed=5), 0.3, seed=0)
    assert train_router(train, held, embedder, candidates=FAST).router.cheaper == {}


def test_the_cheapest_tier_that_meets_the_floor() -> None:
    ladder = ["tiny", SMALL, LARGE]
    assert cheapest_tier({"tiny": 0.9, SMALL: 0.95}, 0.8, ladder) == "tiny"
    assert cheapest_tier({"tiny": 0.5, SMALL: 0.85}, 0.8, ladder) == SMALL
    assert cheapest_tier({"tiny": 0.5, SMALL: 0.6}, 0.8, ladder) == LARGE
    assert cheapest_tier({SMALL: 0.9}, 0.8, ladder) == SMALL  # no tiny prediction: passed over
    assert cheapest_tier({"tiny": 0.99, SMALL: 0.99}, 0.8, [SMALL, LARGE]) == SMALL  # tiny not allowed
    assert cheapest_tier({"tiny": 0.99}, 1.0, ladder) == LARGE  # a floor of 1: everything large


def test_a_tiered_router_survives_saving_and_an_old_one_still_loads(embedder: Embedder, tmp_path: Path) -> None:
    import joblib

    train, held = split()
    router = train_router(
        train, held, embedder, hidden=HiddenData(SPEC, states(train, True), states(held, True, 1))
    ).router
    loaded = load_router(save_router(router, tmp_path / "r"), embedder)
    x = states(held[:5], True, 7)
    for i, e in enumerate(held[:5]):
        assert loaded.p_ok(e.messages, x[i]) == pytest.approx(router.p_ok(e.messages, x[i]))
    assert loaded.hidden_spec == SPEC
    old = save_router(Router(router.classifier, dict(router.metadata, hidden=None)), tmp_path / "old")
    joblib.dump(router.classifier, old / "router.joblib")  # the pre-tier format: one bare classifier
    import hashlib
    import json

    meta = json.loads((old / "router.json").read_text())
    meta["model_sha256"] = hashlib.sha256((old / "router.joblib").read_bytes()).hexdigest()
    (old / "router.json").write_text(json.dumps(meta))
    legacy = load_router(old, embedder)
    assert legacy.hidden_spec is None and legacy.cheaper == {}
    assert set(legacy.p_ok(held[0].messages)) == {SMALL}


def test_bootstrap_interval_holds_the_estimate_and_a_router_minus_itself_is_zero() -> None:
    _, held = split()
    rng = np.random.default_rng(0)
    p = np.array([e.small_ok for e in held]) + rng.normal(0, 0.7, len(held))
    small, large = np.array([e.small_ok for e in held]), np.array([e.large_ok for e in held])
    point = apgr(quality_curve(p, small, large), small.mean(), large.mean())
    lo, hi = bootstrap_apgr(p, held, rounds=300)
    assert lo < point < hi and hi - lo < 0.5
    assert bootstrap_apgr(p, held, rounds=100, minus=p) == (0.0, 0.0)


def test_cli_train_with_the_small_tiers_hidden_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smollm2_dir: Path
) -> None:
    """`router train` computes the states on the small tier (SmolLM2 here), caches them, and a second run
    reads them from the cache; the printout has both intervals."""
    from gateway.cli import main
    from router_model.hidden import FEATURES_DIR
    from router_model.model import read_metadata
    from router_model.synthetic import write_label_file

    monkeypatch.setenv("SWITCHBOARD_HOME", str(smollm2_dir.parents[1]))  # the fetched models' home
    monkeypatch.setenv("SWITCHBOARD_PROFILE", "tiny")  # small = SmolLM2-135M, bf16
    labels = write_label_file(synthetic_examples(120, seed=8), tmp_path / "labels.jsonl")
    args = ["router", "train", "--labels", str(labels), "--folds", "2", "--hidden-layer", "20"]
    assert main([*args, "--router", str(tmp_path / "r1")]) == 0
    out = capsys.readouterr().out
    assert "held-out APGR" in out and "text only" in out and "paired gain CI" in out
    assert "hidden_logistic" in out  # the hidden-state candidates competed
    meta = read_metadata(tmp_path / "r1")
    assert meta["apgr_ci"][0] <= meta["heldout_eval"]["apgr"] <= meta["apgr_ci"][1]
    caches = list((smollm2_dir.parents[1] / FEATURES_DIR).glob("hidden-*.npz"))
    assert caches
    before = {c: c.stat().st_mtime_ns for c in caches}
    assert main([*args, "--router", str(tmp_path / "r2")]) == 0  # every state cached: nothing recomputed
    assert {c: c.stat().st_mtime_ns for c in caches} == before
