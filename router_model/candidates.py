"""The classifiers `router train` compares: on the text features (MiniLM embedding + cheap features) and
on the small tier's hidden state.

Text: logistic regression and kNN (on standardized features) and histogram gradient boosting, each on
the whole embedding and on its first principal components (`_reduced`), plus the cheap features.
Hidden: logistic regression on the standardized hidden state, strongly regularized (896 dimensions
against a few hundred to a few thousand labels), whole and on 64 principal components. On the 596
shipped labels (Qwen2.5-Coder-0.5B int8, layer 18, 5-fold out of fold; Xeon, 2026-11-26): AUC 0.833 /
APGR 0.625 at C=0.01 (0.822 / 0.617 at 0.001, 0.818 / 0.620 at 0.05; 64 components 0.829 / 0.625),
against 0.712 / 0.566 for the text features; adding the cheap features to the state changed nothing
(0.831 / 0.622), nor did scoring by P(small_ok) - P(large_ok) (0.623).
"""

from __future__ import annotations

from collections.abc import Callable

from core.embedder import Embedder

Factory = Callable[[int, int], object]  # (seed, training rows) → an unfitted classifier


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


def _reduced(factory: Factory) -> Factory:
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


CANDIDATES: dict[str, Factory] = {
    "logistic": _logistic,
    "hist_gb": _hist_gb,
    "knn": _knn,
    "logistic_pca": _reduced(_logistic),
    "hist_gb_pca": _reduced(_hist_gb),
    "knn_pca": _reduced(_knn),
}


def _hidden_logistic(seed: int, n: int) -> object:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=5000, random_state=seed))


def _hidden_logistic_pca(seed: int, n: int) -> object:
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    k = max(2, min(64, n // 4))
    pca = PCA(n_components=k, random_state=seed)
    return make_pipeline(StandardScaler(), pca, LogisticRegression(C=0.1, max_iter=5000, random_state=seed))


HIDDEN_CANDIDATES: dict[str, Factory] = {
    "hidden_logistic": _hidden_logistic,
    "hidden_logistic_pca": _hidden_logistic_pca,
}
