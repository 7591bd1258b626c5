"""Training: scikit-learn classifiers compared, the best kept, with what it was trained on.

Candidates: logistic regression and kNN (on standardized features) and histogram gradient boosting,
each on the whole embedding and on its first principal components (`_reduced`), plus the cheap features.
The winner is the one with the best APGR over out-of-fold predictions of a stratified k-fold on the
training split. Not the held-out split: picking by held-out APGR and then reporting held-out APGR
would report the luckiest of three draws. APGR rather than log loss or AUC because it is what routing
buys: it weighs only prompts where the tiers differ, and, like AUC, it depends only on the ranking
(thresholds are calibrated to a share of calls, so probabilities need not be calibrated). AUC of
small_ok breaks a tie (or replaces APGR where the tiers tie on the training split). Held-out APGR,
AUC and log loss of every candidate are recorded in the metadata.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.embedder import Embedder
from router_model.calibrate import DEFAULT_LARGE_SHARE, threshold_for_share
from router_model.candidates import CANDIDATES, HIDDEN_CANDIDATES
from router_model.evaluate import apgr, auc, bootstrap_apgr, evaluate_router, metrics_json, quality_curve
from router_model.examples import (
    DEFAULT_HOME,
    Example,
    ids_hash,
    label_summary,
    load_examples,
    read_label_rows,
    split_examples,
)
from router_model.features import CHEAP_FEATURES, FEATURE_VERSION, featurize
from router_model.floor import MIN_KIND_HELDOUT
from router_model.hidden import HiddenSpec
from router_model.kinds import request_kind
from router_model.model import Router, predict_p_small_ok
from router_model.regions import fit_regions

ALL_CANDIDATES = CANDIDATES | HIDDEN_CANDIDATES


class TrainingError(ValueError):
    """Labels that cannot train a router."""


@dataclass
class CandidateScore:
    cv_apgr: float
    cv_auc: float
    heldout_apgr: float
    heldout_auc: float
    heldout_log_loss: float


@dataclass
class TrainResult:
    router: Router
    scores: dict[str, CandidateScore]
    heldout: list[Example]
    heldout_p: np.ndarray


# examples → (which state, one row per example): the CLI computes them on the small tier's engine
HiddenStates = Callable[[Sequence[Example]], tuple[HiddenSpec, np.ndarray]]


@dataclass(frozen=True)
class HiddenData:
    """The small tier's hidden states of the training and held-out prompts (`router_model.hidden`)."""

    spec: HiddenSpec
    train: np.ndarray
    heldout: np.ndarray


@dataclass
class _Family:
    """The best candidate on one kind of features: its name, fitted model and held-out P(small_ok)."""

    name: str
    model: object
    heldout_p: np.ndarray


def train_router(
    train: Sequence[Example],
    heldout: Sequence[Example],
    embedder: Embedder,
    *,
    seed: int = 0,
    folds: int = 5,
    candidates: Sequence[str] = tuple(CANDIDATES),
    large_share: float = DEFAULT_LARGE_SHARE,
    hidden: HiddenData | None = None,
    bootstrap: int = 1000,
) -> TrainResult:
    """Select a classifier by cross-validated APGR on `train`, fit it on all of `train`, score on `heldout`.

    With `hidden`, the hidden-state candidates compete too; the router keeps the best text classifier
    either way (its fallback when the small tier cannot compute a state in time). Labels with `tiny_ok`
    also train P(tiny_ok) on the winning kind of features (and on text). The router's threshold sends
    `large_share` of the held-out prompts to the large tier."""
    y = np.array([e.small_ok for e in train])
    if y.all() or not y.any():
        raise TrainingError(f"every training label is small_ok={bool(y[0])}: nothing to learn")
    x_train = featurize([e.messages for e in train], embedder)
    x_held = featurize([e.messages for e in heldout], embedder)
    scores: dict[str, CandidateScore] = {}
    text = _select(candidates, x_train, x_held, train, heldout, seed, folds, scores)
    best = text
    if hidden is not None:
        found = _select(tuple(HIDDEN_CANDIDATES), hidden.train, hidden.heldout, train, heldout, seed, folds, scores)
        if (_nan_low(scores[found.name].cv_apgr), _nan_low(scores[found.name].cv_auc)) > (
            _nan_low(scores[text.name].cv_apgr),
            _nan_low(scores[text.name].cv_auc),
        ):
            best = found
    threshold = threshold_for_share(held_p := best.heldout_p, large_share)
    uses_hidden = best is not text
    tiers = _cheaper_tiers(
        train, x_train, hidden.train if uses_hidden and hidden else None, text.name, best.name, seed, folds
    )
    metadata = {
        "feature_version": FEATURE_VERSION,
        "cheap_features": list(CHEAP_FEATURES),
        "classifier": best.name,
        "classifier_repr": repr(best.model),
        "text_classifier": text.name,
        "features": "hidden" if uses_hidden else "text",
        "hidden": hidden.spec.as_dict() if uses_hidden and hidden else None,
        "selected_by": f"out-of-fold APGR, {folds}-fold stratified by source on the training split",
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "train_ids_hash": ids_hash(train),
        "train_ids": sorted(e.id for e in train),
        "n_train": len(train),
        "n_heldout": len(heldout),
        "seed": seed,
        "labels_train": label_summary(train),
        "labels_heldout": label_summary(heldout),
        "metrics": {n: {k: _json_number(v) for k, v in s.__dict__.items()} for n, s in scores.items()},
        "heldout_eval": metrics_json(evaluate_router(held_p, heldout)),  # the kept one against the baselines
        "heldout_eval_text": metrics_json(evaluate_router(text.heldout_p, heldout)),
        "apgr_ci": _ci(bootstrap_apgr(held_p, heldout, rounds=bootstrap, seed=seed)),
        "apgr_ci_text": _ci(bootstrap_apgr(text.heldout_p, heldout, rounds=bootstrap, seed=seed)),
        "apgr_gain_ci": _ci(bootstrap_apgr(held_p, heldout, rounds=bootstrap, seed=seed, minus=text.heldout_p)),
        "tiers": {name: info for name, (_, _, info) in tiers.items()},
        "threshold": threshold,
        "threshold_from": f"large share {large_share} of the held-out split",
        "large_share": float(np.mean(held_p < threshold)),  # sent large there: what the drift gauge expects
        "tenant_thresholds": {},
        "heldout_curve": _curve(held_p, heldout),
    }
    metadata["heldout_curve"] |= _tiny_curve(tiers["tiny"], x_held, hidden, heldout) if "tiny" in tiers else {}
    router = Router(
        text.model, metadata, embedder, hidden_classifier=best.model if uses_hidden else None,
        cheaper={name: (t, h) for name, (t, h, _) in tiers.items()},
    )  # fmt: skip
    router.regions, metadata["kinds"] = fit_regions(np.vstack([x_train, x_held]), seed), _kinds(train, heldout)
    return TrainResult(router, scores, list(heldout), held_p)


def _curve(held_p: np.ndarray, heldout: Sequence[Example]) -> dict[str, list]:
    """The kept classifier's held-out curve, so a quality floor becomes a threshold without rescoring; with each
    prompt's kind and group (a tool request that needs a call, or none), so the floor is kept on each
    (`router_model.floor`)."""
    kinds = [request_kind(e.messages) for e in heldout]
    return {
        "p": [round(float(x), 6) for x in held_p],
        "small_ok": [bool(e.small_ok) for e in heldout],
        "large_ok": [bool(e.large_ok) for e in heldout],
        "kind": kinds,
        "group": [_group(k, e.needs_call) for k, e in zip(kinds, heldout, strict=True)],
    }


def _group(kind: str, needs_call: bool | None) -> str:
    return kind if needs_call is None else f"{kind}/{'call' if needs_call else 'none'}"


def _kinds(train: Sequence[Example], heldout: Sequence[Example]) -> list[str]:
    """The kinds of request the router knows (`router_model.kinds`): those with `MIN_KIND_HELDOUT` held-out labels,
    on which its floor can be kept (`Router.threshold_for_floor`); a kind with fewer, or none, is out of
    distribution. Labels too few for any kind to have that many (a small test file): the kind most of them are."""
    counts = Counter(request_kind(e.messages) for e in heldout)
    known = sorted(k for k, n in counts.items() if n >= MIN_KIND_HELDOUT)
    if known:
        return known
    every = Counter(request_kind(e.messages) for e in (*train, *heldout))
    return [every.most_common(1)[0][0]] if every else []


def _tiny_curve(
    tiny: tuple[object, object | None, dict], x_held: np.ndarray, hidden: HiddenData | None, heldout: Sequence[Example]
) -> dict[str, list]:
    """The tiny tier's held-out P(tiny_ok) (from the hidden state where its model reads one) and verdicts, kept
    on the curve so that a quality floor counts tiny's answers too."""
    text_tiny, hidden_tiny, _ = tiny
    if hidden_tiny is not None and hidden is not None:
        p_tiny = predict_p_small_ok(hidden_tiny, hidden.heldout)
    else:
        p_tiny = predict_p_small_ok(text_tiny, x_held)
    return {"p_tiny": [round(float(x), 6) for x in p_tiny], "tiny_ok": [e.tiny_ok for e in heldout]}


def _select(
    names: Sequence[str],
    x_train: np.ndarray,
    x_held: np.ndarray,
    train: Sequence[Example],
    heldout: Sequence[Example],
    seed: int,
    folds: int,
    scores: dict[str, CandidateScore],
) -> _Family:
    """Score each candidate (out of fold on `train`, and on `heldout`) into `scores`; the best by cv APGR."""
    y = np.array([e.small_ok for e in train])
    fitted = {}
    for name in names:
        oof = _out_of_fold(name, x_train, y, [e.source for e in train], seed, folds)
        model = _fit(name, x_train, y, seed)
        held_p = predict_p_small_ok(model, x_held)
        scores[name] = CandidateScore(
            cv_apgr=_apgr(oof, train), cv_auc=auc(y, oof),
            heldout_apgr=_apgr(held_p, heldout), heldout_auc=auc(np.array([e.small_ok for e in heldout]), held_p),
            heldout_log_loss=_log_loss(held_p, heldout),
        )  # fmt: skip
        fitted[name] = _Family(name, model, held_p)
    best = max(names, key=lambda n: (_nan_low(scores[n].cv_apgr), _nan_low(scores[n].cv_auc)))
    return fitted[best]


MIN_TIER_LABELS = 50  # rows with a tier's verdict, of each class, before P(that tier is good enough) is trained


def _cheaper_tiers(
    train: Sequence[Example], x_text: np.ndarray, x_hidden: np.ndarray | None, text_name: str, hidden_name: str,
    seed: int, folds: int = 5,
) -> dict[str, tuple[object, object | None, dict]]:  # fmt: skip
    """P(tiny_ok) where the labels say enough about it: (text model, hidden model or None, what it learned
    from). The same classifiers the small tier's prediction chose, fitted to the rows with `tiny_ok`."""
    rows = np.array([e.tiny_ok is not None for e in train])
    t = np.array([bool(e.tiny_ok) for e in train])[rows]
    if min(t.sum(), len(t) - t.sum()) < MIN_TIER_LABELS:
        return {}
    sources = [e.source for e, r in zip(train, rows, strict=True) if r]
    info = {"n": len(t), "ok_rate": round(float(t.mean()), 4)}
    text = _fit(text_name, x_text[rows], t, seed)
    info["cv_auc_text"] = _json_number(auc(t, _out_of_fold(text_name, x_text[rows], t, sources, seed, folds)))
    hidden = None
    if x_hidden is not None:
        hidden = _fit(hidden_name, x_hidden[rows], t, seed)
        info["cv_auc_hidden"] = _json_number(auc(t, _out_of_fold(hidden_name, x_hidden[rows], t, sources, seed, folds)))
    return {"tiny": (text, hidden, info)}


def train_from_labels(
    labels: Path, embedder: Embedder, *, home: Path = DEFAULT_HOME, test_size: float = 0.2, seed: int = 0,
    folds: int = 5, candidates: Sequence[str] = tuple(CANDIDATES), hidden_states: HiddenStates | None = None,
) -> TrainResult:  # fmt: skip
    """Load a label file, split it (seeded, stratified by source) and train; the file is named in the metadata.
    `hidden_states`: the small tier's states of the examples (`router_model.hidden`), to compete with text."""
    examples = load_examples(labels, home)
    train, heldout = split_examples(examples, test_size, seed)
    hidden = None
    if hidden_states is not None:
        spec, states = hidden_states([*train, *heldout])
        hidden = HiddenData(spec, states[: len(train)], states[len(train) :])
    result = train_router(train, heldout, embedder, seed=seed, folds=folds, candidates=candidates, hidden=hidden)
    models = {f"{r['small_model']} / {r['large_model']}" for r in read_label_rows(labels) if "small_model" in r}
    result.router.metadata |= {
        "label_models": sorted(models),  # small / large: the tiers whose answers were graded
        "label_file": str(Path(labels).resolve()),
        "label_file_sha256": hashlib.sha256(Path(labels).read_bytes()).hexdigest(),
        "test_size": test_size,
    }
    return result


def heldout_examples(examples: Sequence[Example], metadata: dict) -> list[Example]:
    """The examples a router was not trained on (its held-out split, plus rows labeled since)."""
    trained = set(metadata.get("train_ids", ()))
    return [e for e in examples if e.id not in trained]


def format_scores(scores: dict[str, CandidateScore], chosen: str) -> str:
    lines = [f"{'classifier':<10} {'cv APGR':>8} {'cv AUC':>7} {'APGR':>7} {'AUC':>7} {'log loss':>9}"]
    for name, s in scores.items():
        mark = "  <- kept" if name == chosen else ""
        lines.append(
            f"{name:<10} {s.cv_apgr:>8.3f} {s.cv_auc:>7.3f} {s.heldout_apgr:>7.3f} {s.heldout_auc:>7.3f} "
            f"{s.heldout_log_loss:>9.3f}{mark}"
        )
    return "\n".join(lines)


def _fit(name: str, x: np.ndarray, y: np.ndarray, seed: int) -> object:
    from threadpoolctl import threadpool_limits

    model = ALL_CANDIDATES[name](seed, len(y))
    # One thread: on a few hundred rows OpenMP's synchronization costs more than it saves, and on a
    # busy machine gradient boosting ran 10x slower with two threads than with one.
    with threadpool_limits(1):
        model.fit(x, y)  # type: ignore[attr-defined]
    return model


def _out_of_fold(name: str, x: np.ndarray, y: np.ndarray, sources: list[str], seed: int, folds: int) -> np.ndarray:
    """P(label) for each training row from a model that did not see it."""
    from sklearn.model_selection import StratifiedKFold

    smallest = min(sources.count(s) for s in set(sources))
    k = max(2, min(folds, smallest))
    groups = sources if smallest >= k else y  # stratify by source where every source fills every fold
    out = np.full(len(y), np.nan)
    for fit_idx, val_idx in StratifiedKFold(k, shuffle=True, random_state=seed).split(x, groups):
        if y[fit_idx].all() or not y[fit_idx].any():
            out[val_idx] = y[fit_idx].mean()  # a one-class fold predicts its class
            continue
        model = _fit(name, x[fit_idx], y[fit_idx], seed)
        out[val_idx] = predict_p_small_ok(model, x[val_idx])
    return out


def _apgr(p: np.ndarray, examples: Sequence[Example]) -> float:
    small = np.array([e.small_ok for e in examples])
    large = np.array([e.large_ok for e in examples])
    return apgr(quality_curve(p, small, large), float(small.mean()), float(large.mean()))


def _ci(interval: tuple[float, float]) -> list[float | None]:
    return [_json_number(interval[0]), _json_number(interval[1])]


def _log_loss(p: np.ndarray, examples: Sequence[Example]) -> float:
    from sklearn.metrics import log_loss

    return float(log_loss([e.small_ok for e in examples], p, labels=[False, True]))


def _json_number(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x
