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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.embedder import Embedder
from router_model.calibrate import DEFAULT_LARGE_SHARE, threshold_for_share
from router_model.evaluate import apgr, evaluate_router, metrics_json, quality_curve
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
from router_model.model import Router, predict_p_small_ok


def _logistic(seed: int, n: int) -> object:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # strong L2: a few hundred examples against ~400 features
    return make_pipeline(StandardScaler(), LogisticRegression(C=0.05, max_iter=5000, random_state=seed))


def _hist_gb(seed: int, n: int) -> object:
    from sklearn.ensemble import HistGradientBoostingClassifier

    # each tree sees half the features: a regularizer with ~400 features and a few hundred examples
    return HistGradientBoostingClassifier(
        max_iter=100, learning_rate=0.08, max_leaf_nodes=15, min_samples_leaf=max(5, min(20, n // 20)),
        max_features=0.5, l2_regularization=1.0, random_state=seed,
    )  # fmt: skip


def _knn(seed: int, n: int) -> object:
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # distance weights: continuous probabilities, so a threshold can hit any share of calls
    k = max(1, min(25, n // 4))
    return make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=k, weights="distance", metric="cosine"))


EMBEDDING_COMPONENTS = 8


def _reduced(factory: Callable[[int, int], object]) -> Callable[[int, int], object]:
    """`factory`'s classifier on the embedding's first principal components plus the cheap features.

    A few hundred labels cannot fit 384 embedding weights: on the GSM8K labels alone (which of them the
    small tier solves) the whole embedding took logistic regression's cross-validated AUC from 0.71 (cheap
    features only) to 0.57, while 8 components kept 0.71 and still tell the sources and topics apart."""

    def build(seed: int, n: int) -> object:
        from sklearn.compose import ColumnTransformer
        from sklearn.decomposition import PCA
        from sklearn.pipeline import make_pipeline

        pca = PCA(n_components=EMBEDDING_COMPONENTS, random_state=seed)
        reduce = ColumnTransformer([("embedding", pca, list(range(Embedder.DIM)))], remainder="passthrough")
        return make_pipeline(reduce, factory(seed, n))

    return build


CANDIDATES: dict[str, Callable[[int, int], object]] = {
    "logistic": _logistic,
    "hist_gb": _hist_gb,
    "knn": _knn,
    "logistic_pca": _reduced(_logistic),
    "hist_gb_pca": _reduced(_hist_gb),
    "knn_pca": _reduced(_knn),
}


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


def train_router(
    train: Sequence[Example],
    heldout: Sequence[Example],
    embedder: Embedder,
    *,
    seed: int = 0,
    folds: int = 5,
    candidates: Sequence[str] = tuple(CANDIDATES),
    large_share: float = DEFAULT_LARGE_SHARE,
) -> TrainResult:
    """Select a classifier by cross-validated APGR on `train`, fit it on all of `train`, score on `heldout`.

    The router's threshold sends `large_share` of the held-out prompts to the large tier."""
    y = np.array([e.small_ok for e in train])
    if y.all() or not y.any():
        raise TrainingError(f"every training label is small_ok={bool(y[0])}: nothing to learn")
    x_train = featurize([e.messages for e in train], embedder)
    x_held = featurize([e.messages for e in heldout], embedder)
    scores, fitted = {}, {}
    for name in candidates:
        oof = _out_of_fold(name, x_train, train, seed, folds)
        model = _fit(name, x_train, y, seed)
        held_p = predict_p_small_ok(model, x_held)
        scores[name] = CandidateScore(
            cv_apgr=_apgr(oof, train), cv_auc=_auc(oof, train),
            heldout_apgr=_apgr(held_p, heldout), heldout_auc=_auc(held_p, heldout),
            heldout_log_loss=_log_loss(held_p, heldout),
        )  # fmt: skip
        fitted[name] = (model, held_p)
    best = max(scores, key=lambda n: (_nan_low(scores[n].cv_apgr), _nan_low(scores[n].cv_auc)))
    model, held_p = fitted[best]
    threshold = threshold_for_share(held_p, large_share)
    metadata = {
        "feature_version": FEATURE_VERSION,
        "cheap_features": list(CHEAP_FEATURES),
        "classifier": best,
        "classifier_repr": repr(model),
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
        "threshold": threshold,
        "threshold_from": f"large share {large_share} of the held-out split",
        "large_share": float(np.mean(held_p < threshold)),  # sent large there: what the drift gauge expects
        "tenant_thresholds": {},
    }
    return TrainResult(Router(model, metadata, embedder), scores, list(heldout), held_p)


def train_from_labels(
    labels: Path, embedder: Embedder, *, home: Path = DEFAULT_HOME, test_size: float = 0.2, seed: int = 0,
    folds: int = 5, candidates: Sequence[str] = tuple(CANDIDATES),
) -> TrainResult:  # fmt: skip
    """Load a label file, split it (seeded, stratified by source) and train; the file is named in the metadata."""
    examples = load_examples(labels, home)
    train, heldout = split_examples(examples, test_size, seed)
    result = train_router(train, heldout, embedder, seed=seed, folds=folds, candidates=candidates)
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

    model = CANDIDATES[name](seed, len(y))
    # One thread: on a few hundred rows OpenMP's synchronization costs more than it saves, and on a
    # busy machine gradient boosting ran 10x slower with two threads than with one.
    with threadpool_limits(1):
        model.fit(x, y)  # type: ignore[attr-defined]
    return model


def _out_of_fold(name: str, x: np.ndarray, examples: Sequence[Example], seed: int, folds: int) -> np.ndarray:
    """P(small_ok) for each training example from a model that did not see it."""
    from sklearn.model_selection import StratifiedKFold

    y = np.array([e.small_ok for e in examples])
    sources = [e.source for e in examples]
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


def _auc(p: np.ndarray, examples: Sequence[Example]) -> float:
    from sklearn.metrics import roc_auc_score

    y = [e.small_ok for e in examples]
    return float(roc_auc_score(y, p)) if 0 < sum(y) < len(y) else math.nan


def _log_loss(p: np.ndarray, examples: Sequence[Example]) -> float:
    from sklearn.metrics import log_loss

    return float(log_loss([e.small_ok for e in examples], p, labels=[False, True]))


def _json_number(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def _nan_low(x: float) -> float:
    return -math.inf if math.isnan(x) else x
