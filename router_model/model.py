"""A trained router: its classifier, its metadata, saving and loading, and the routing decision.

On disk a router is a directory with `router.joblib` (the scikit-learn pipeline) and `router.json`
(feature version, classifier, training ids hash, metrics, date, label file, thresholds). joblib is
pickle: load routers only from directories you wrote. `load_router` refuses a router whose feature
version differs from this code's, and one whose model file is not the one its metadata names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from threadpoolctl import ThreadpoolController

from core.embedder import Embedder
from engines.checkpoints.fetch import sha256_file
from router_model.encoder import RouterEncoder
from router_model.features import FEATURE_VERSION, Messages, featurize
from router_model.floor import floor_threshold
from router_model.hidden import HiddenSpec
from router_model.kinds import TEXT, request_kind
from router_model.regions import Regions

TINY, SMALL, LARGE = "tiny", "small", "large"
MODEL_FILE, METADATA_FILE = "router.joblib", "router.json"
# Probabilities stay inside (0, 1), so a threshold of 0 sends nothing large and 1 sends everything large.
_EPS = 1e-6
# A routing decision scores one row: starting OpenMP threads for it costs more than the work (gradient
# boosting, one row, busy 2-CPU machine: 16 ms on two threads, 1.3 ms on one).
_FEW_ROWS = 64
_controller: ThreadpoolController | None = None


def _openmp() -> ThreadpoolController:
    global _controller
    if _controller is None:  # built on first use, once the classifier's OpenMP runtime is loaded
        _controller = ThreadpoolController()
    return _controller


class RouterLoadError(ValueError):
    """A saved router that this code cannot use."""


@dataclass(frozen=True)
class Assessment:
    """What the router knows about one conversation: P(good enough) per tier it predicts, the region of its
    labels the prompt lies in, the request's kind, and whether its labels cover it (`why` not: "tools" for a
    kind without labels, "far" for a prompt unlike every labeled one)."""

    p_ok: dict[str, float]
    region: int | None = None  # None: a router trained before regions
    kind: str = TEXT
    distance: float | None = None
    known: bool = True
    why: str = ""


@dataclass
class Router:
    """Predicts P(small tier is good enough) and routes: large when it falls below the threshold.

    `classifier` reads the text features and is always there; `hidden_classifier`, where training kept
    one, reads the small tier's hidden state of the prompt (`hidden_spec` says which) and is preferred
    whenever that state is at hand. `cheaper` predicts, for tiers below small (tiny), whether their answer
    would do: (text classifier, hidden-state classifier or None)."""

    classifier: object  # a fitted scikit-learn classifier with predict_proba; class 1 = small_ok
    metadata: dict = field(default_factory=dict)
    embedder: Embedder = field(default_factory=RouterEncoder)
    hidden_classifier: object | None = None
    cheaper: dict[str, tuple[object, object | None]] = field(default_factory=dict)
    regions: Regions | None = None  # where its labeled prompts lie (`router_model.regions`); None: an older router
    # `threshold_for_floor` by ratio: a tenant's floor is asked on every routed request, the curve is fixed
    _floors: dict[tuple[float, bool, str | None], tuple[float, float] | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def hidden_spec(self) -> HiddenSpec | None:
        """The hidden state the router wants (tier, model, layer), or None for a text-only router."""
        spec = self.metadata.get("hidden")
        return HiddenSpec.from_dict(spec) if spec and self.hidden_classifier is not None else None

    def p_ok(self, messages: Messages, hidden: np.ndarray | None = None) -> dict[str, float]:
        """P(the tier's answer is good enough) for one conversation: small, and each cheaper tier. From the
        hidden state where given (and a classifier reads it), else from the text features."""
        return self.assess(messages, hidden).p_ok

    def assess(self, messages: Messages, hidden: np.ndarray | None = None) -> Assessment:
        """P(good enough) per tier (`p_ok`), and where the prompt lies among the labels: its region, kind and
        whether the labels cover it (a kind they hold, within the regions' radius of a labeled prompt)."""
        state = None if hidden is None else np.asarray(hidden, np.float32).reshape(1, -1)
        text: np.ndarray | None = None

        def features() -> np.ndarray:
            nonlocal text
            if text is None:
                text = featurize([messages], self.embedder)
            return text

        def score(text_model: object, hidden_model: object | None) -> float:
            if state is not None and hidden_model is not None:
                return float(predict_p_small_ok(hidden_model, state)[0])
            return float(predict_p_small_ok(text_model, features())[0])

        out = {SMALL: score(self.classifier, self.hidden_classifier)}
        for tier, (text_model, hidden_model) in self.cheaper.items():
            out[tier] = score(text_model, hidden_model)
        kind = request_kind(messages)
        if self.regions is None:
            return Assessment(out, kind=kind, known=kind in self.kinds, why="" if kind in self.kinds else kind)
        place = self.regions.place(features())[0]
        why = kind if kind not in self.kinds else ("" if place.known else "far")
        return Assessment(out, place.region, kind, round(place.distance, 4), not why, why)

    @property
    def kinds(self) -> list[str]:
        """The kinds of request its labels hold (`router_model.kinds`); text for a router that did not record them."""
        return list(self.metadata.get("kinds") or [TEXT])

    @property
    def threshold(self) -> float:
        return float(self.metadata.get("threshold", 0.5))

    def threshold_for_floor(
        self, ratio: float, tiny: bool = False, kind: str | None = None
    ) -> tuple[float, float] | None:
        """(threshold, the share it sends large) holding `auto`'s quality to `ratio` of always-large's on the
        router's held-out curve: the fewest large calls whose quality there is at least ratio × the large
        tier's. `tiny`: the tiny tier is on the ladder too (served and allowed), so the curve routes each
        prompt as `cheapest_tier` would, tiny verdicts included (a router with a P(tiny_ok) keeps them on its
        curve). `kind`: on that kind's held-out prompts, and each finer group of it the curve marks
        (`router_model.floor`), so the floor holds per kind of request, not only on the average (a router that kept
        no kinds on its curve: the whole curve). The large share is on the kind's prompts. None for a router trained
        before the curve was kept, or for a kind its curve has too few prompts of."""
        curve = self.metadata.get("heldout_curve")
        with_tiny = bool(tiny and curve and curve.get("p_tiny"))
        key = (ratio, with_tiny, kind if curve and curve.get("kind") else None)
        if key not in self._floors:
            self._floors[key] = floor_threshold(curve, ratio, with_tiny, key[2]) if curve and curve.get("p") else None
        return self._floors[key]

    def threshold_for(self, tenant: str | None = None) -> float:
        """The tenant's calibrated threshold where there is one, else the global one."""
        return float(self.metadata.get("tenant_thresholds", {}).get(tenant, self.threshold))

    def large_share_for(self, tenant: str | None = None) -> float | None:
        """The share of its calibration prompts that `threshold_for(tenant)` sent large; None if not recorded."""
        if tenant in self.metadata.get("tenant_thresholds", {}):
            share = self.metadata.get("tenant_large_shares", {}).get(tenant)
        else:
            share = self.metadata.get("large_share")
        return None if share is None else float(share)

    @property
    def id(self) -> str:
        """Names this trained model: a threshold calibrated for one router means nothing to another."""
        return str(self.metadata.get("model_sha256", ""))

    def p_small_ok(self, conversations: Sequence[Messages]) -> np.ndarray:
        return self.p_small_ok_features(featurize(conversations, self.embedder))

    def p_small_ok_features(self, features: np.ndarray) -> np.ndarray:
        return predict_p_small_ok(self.classifier, features)

    def route(self, messages: Messages, threshold: float | None = None) -> tuple[str, float]:
        """(tier, P(small is good enough)) for one conversation."""
        p = float(self.p_small_ok([messages])[0])
        return (LARGE if p < (self.threshold if threshold is None else threshold) else SMALL), p


def cheapest_tier(p_ok: Mapping[str, float], floor: float, ladder: Sequence[str]) -> str:
    """The first tier of `ladder` (cheapest first, the largest last) whose predicted P(good enough) meets
    `floor`; the largest when none does: it is the reference the labels grade the others against. A tier
    without a prediction is passed over."""
    for tier in ladder[:-1]:
        if tier in p_ok and p_ok[tier] >= floor:
            return tier
    return ladder[-1]


def router_dir(home: Path) -> Path:
    """Where a router lives by default: under the settings' home (~/.cache/switchboard/router)."""
    return Path(home).expanduser() / "router"


def predict_p_small_ok(classifier: object, features: np.ndarray) -> np.ndarray:
    """P(small_ok) per row of features from a fitted classifier, kept inside (0, 1)."""
    if len(features) == 0:
        return np.zeros(0)
    if len(features) <= _FEW_ROWS:
        with _openmp().limit(limits=1, user_api="openmp"):  # this thread's OpenMP only; BLAS untouched
            proba = classifier.predict_proba(features)  # type: ignore[attr-defined]
    else:
        proba = classifier.predict_proba(features)  # type: ignore[attr-defined]
    column = list(classifier.classes_).index(True)  # type: ignore[attr-defined]
    return np.clip(proba[:, column], _EPS, 1 - _EPS)


def save_router(router: Router, directory: Path) -> Path:
    """Write the model and its metadata; each file is replaced atomically, the model first."""
    import joblib

    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{MODEL_FILE}.{os.getpid()}"
    stored = {"format": 2, "small": (router.classifier, router.hidden_classifier), "cheaper": router.cheaper,
              "regions": router.regions}  # fmt: skip
    joblib.dump(stored, tmp)
    router.metadata["model_sha256"] = sha256_file(tmp)
    os.replace(tmp, directory / MODEL_FILE)
    write_metadata(router.metadata, directory)
    return directory


def write_metadata(metadata: dict, directory: Path) -> None:
    tmp = Path(directory) / f".{METADATA_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(tmp, Path(directory) / METADATA_FILE)


def read_metadata(directory: Path) -> dict:
    path = Path(directory).expanduser() / METADATA_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RouterLoadError(
            f"no router at {path.parent} ({METADATA_FILE} missing): run `switchboard router train`"
        ) from None
    except json.JSONDecodeError as exc:
        raise RouterLoadError(f"{path}: not JSON ({exc.msg})") from None


def load_router(directory: Path, embedder: Embedder | None = None) -> Router:
    """The router saved in `directory`; RouterLoadError if its features or files do not match this code."""
    import joblib

    directory = Path(directory).expanduser()
    metadata = read_metadata(directory)
    version = metadata.get("feature_version")
    if version != FEATURE_VERSION:
        raise RouterLoadError(
            f"router at {directory} was trained on features {version!r}, this code computes {FEATURE_VERSION!r}: "
            "retrain it with `switchboard router train`"
        )
    model = directory / MODEL_FILE
    if not model.exists():
        raise RouterLoadError(f"router at {directory}: {MODEL_FILE} missing")
    if metadata.get("model_sha256") != sha256_file(model):
        raise RouterLoadError(f"router at {directory}: {MODEL_FILE} is not the model {METADATA_FILE} describes")
    stored = joblib.load(model)
    if isinstance(stored, dict) and stored.get("format") == 2:
        (text, hidden), cheaper = stored["small"], stored["cheaper"]
        return Router(text, metadata, embedder or RouterEncoder(), hidden_classifier=hidden, cheaper=cheaper,
                      regions=stored.get("regions"))  # fmt: skip
    return Router(stored, metadata, embedder or RouterEncoder())  # a text-only router from before tiers
