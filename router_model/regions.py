"""Where a prompt lies among the router's labeled prompts: its region (the nearest of k-means centroids of the
labels' embeddings) and whether the labels cover it at all (its distance to the nearest labeled prompt).

Regions are the cells a tenant's own verdicts are counted in (`router_model.tenant_layer`): few enough that
a tenant fills them (32 for ~1,400 labels, ~40 labels each), fine enough to part GSM8K from capitals and
chat openers. A prompt farther from every labeled prompt (cosine distance of its MiniLM embedding) than
`radius` (the 99th percentile of the labels' own leave-one-out nearest distances) is unlike anything the
router has verdicts for: `known` is False, and `auto` does not route it below a tier whose quality is known
for it. Built when the router is trained (`router_model.train`), saved in its model file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.embedder import Embedder

__all__ = ["LABELS_PER_REGION", "MAX_REGIONS", "RADIUS_QUANTILE", "Place", "Regions", "fit_regions"]

MAX_REGIONS = 32
LABELS_PER_REGION = 40  # fewer regions on a small label set: each keeps ~40 labels
RADIUS_QUANTILE = 0.99  # of the labels' leave-one-out nearest distances: 1% of labeled prompts would be "far"


@dataclass(frozen=True)
class Place:
    region: int
    distance: float  # cosine distance to the nearest labeled prompt
    known: bool  # within `radius` of a labeled prompt


@dataclass
class Regions:
    centroids: np.ndarray  # (k, 384) float32, unit length
    labeled: np.ndarray  # (n, 384) float16: the labeled prompts' unit embeddings
    radius: float

    def place(self, features: np.ndarray) -> list[Place]:
        """One Place per row of router features (the embedding first, as `router_model.features.featurize`)."""
        x = _unit(np.asarray(features, np.float32)[:, : Embedder.DIM])
        region = np.argmax(x @ self.centroids.T, axis=1)
        nearest = 1.0 - np.max(x @ self.labeled.astype(np.float32).T, axis=1)
        return [Place(int(r), float(d), bool(d <= self.radius + 1e-6)) for r, d in zip(region, nearest, strict=True)]


def fit_regions(features: np.ndarray, seed: int = 0) -> Regions:
    """Regions over the labeled prompts' router features (k-means on their unit embeddings)."""
    from sklearn.cluster import KMeans

    x = _unit(np.asarray(features, np.float32)[:, : Embedder.DIM])
    if len(x) < 2:
        raise ValueError("regions need two labeled prompts or more")
    k = int(min(MAX_REGIONS, max(2, len(x) // LABELS_PER_REGION)))
    km = KMeans(n_clusters=k, n_init=4, random_state=seed).fit(x)
    similarity = x @ x.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = 1.0 - similarity.max(axis=1)
    return Regions(_unit(km.cluster_centers_.astype(np.float32)), x.astype(np.float16),
                   float(np.quantile(nearest, RADIUS_QUANTILE)))  # fmt: skip


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
