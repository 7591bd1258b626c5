"""A learned verifier: P(the answer is right) from the MiniLM embedding of question and answer plus a few
cheap features of the answer, by logistic regression.

Trained on graded answers (`verifiers.probe_data`: the small tier's answers to the router's labeled
GSM8K and HumanEval prompts). Saved as `probe.joblib` + `probe.json` (feature version, training size,
out-of-fold AUC, the threshold with the best out-of-fold balanced accuracy).
`ProbeCheck` is a final check: below the threshold it escalates.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.embedder import Embedder
from grading.answers import extract_answer
from router_model.evaluate import auc
from verifiers.base import Action, Context, Trace, TraceVerifier, Verdict

FEATURE_VERSION = "probe-minilm-int8+answer-1"
MODEL_FILE, METADATA_FILE = "probe.joblib", "probe.json"
_WORD = re.compile(r"\w+")
log = logging.getLogger(__name__)


def answer_features(answer: str) -> np.ndarray:
    """Cheap signals of a bad answer: no final number, length, how much of it repeats."""
    words = _WORD.findall(answer.lower())
    distinct = len(set(words)) / len(words) if words else 0.0
    lines = [line.strip() for line in answer.splitlines() if line.strip()]
    repeated = 1.0 - len(set(lines)) / len(lines) if lines else 0.0
    values = [float(extract_answer(answer) is not None), math.log1p(len(answer)), distinct, repeated]
    return np.asarray(values, dtype=np.float32)


def probe_text(question: str, answer: str) -> str:
    """What MiniLM embeds: the question's head and the answer's tail, where its conclusion is."""
    return f"{question[:300]}\n\n{answer[-600:]}"


def featurize(pairs: Sequence[tuple[str, str]], encoder: Embedder) -> np.ndarray:
    vectors = encoder.encode([probe_text(q, a) for q, a in pairs])
    cheap = np.stack([answer_features(a) for _, a in pairs]) if pairs else np.zeros((0, 4), np.float32)
    return np.hstack([vectors, cheap]).astype(np.float32)


@dataclass
class AnswerProbe:
    classifier: object
    encoder: Embedder
    metadata: dict = field(default_factory=dict)

    @classmethod
    def train(
        cls, pairs: Sequence[tuple[str, str]], correct: Sequence[bool], encoder: Embedder, *, seed: int = 0
    ) -> AnswerProbe:
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import StratifiedKFold, cross_val_predict
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        y = np.asarray(correct, bool)
        if y.all() or not y.any():
            raise ValueError("the probe needs right and wrong answers to learn from")
        x = featurize(pairs, encoder)
        model = make_pipeline(StandardScaler(), LogisticRegression(C=0.05, max_iter=5000, random_state=seed))
        folds = max(2, min(5, int(y.sum()), int((~y).sum())))
        oof = cross_val_predict(
            model, x, y, cv=StratifiedKFold(folds, shuffle=True, random_state=seed), method="predict_proba"
        )
        model.fit(x, y)
        metadata = {
            "feature_version": FEATURE_VERSION,
            "n_train": len(y),
            "share_correct": float(y.mean()),
            "cv_auc": auc(y, oof[:, 1]),
            **_balanced_threshold(y, oof[:, 1]),
        }
        return cls(model, encoder, metadata)

    def p_correct(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        return self.classifier.predict_proba(featurize(pairs, self.encoder))[:, 1]  # type: ignore[attr-defined]

    def save(self, directory: Path) -> Path:
        import joblib

        directory.mkdir(parents=True, exist_ok=True)
        joblib.dump(self.classifier, directory / MODEL_FILE)
        (directory / METADATA_FILE).write_text(json.dumps(self.metadata, indent=2))
        return directory

    @classmethod
    def load(cls, directory: Path, encoder: Embedder) -> AnswerProbe:
        """joblib is pickle: load probes only from directories you wrote."""
        import joblib

        metadata = json.loads((directory / METADATA_FILE).read_text())
        if metadata.get("feature_version") != FEATURE_VERSION:
            raise ValueError(
                f"{directory}: a probe for features {metadata.get('feature_version')!r}, not {FEATURE_VERSION!r}"
            )
        return cls(joblib.load(directory / MODEL_FILE), encoder, metadata)


def load_probe(directory: Path, encoder: Embedder) -> AnswerProbe | None:
    """The probe saved in `directory`; None where there is none or it cannot be used (logged)."""
    if not (directory / METADATA_FILE).is_file():
        return None
    try:
        probe = AnswerProbe.load(directory, encoder)
    except (OSError, ValueError) as exc:
        log.warning("the answer probe is unavailable: %s", exc)
        return None
    log.info("answer probe loaded from %s (out-of-fold AUC %.3f)", directory, probe.metadata.get("cv_auc", 0.0))
    return probe


class ProbeCheck(TraceVerifier):
    name = "probe"

    def __init__(self, probe: AnswerProbe, threshold: float | None = None) -> None:
        self.probe = probe
        self.threshold = float(probe.metadata.get("threshold", 0.5)) if threshold is None else threshold

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        p = float(self.probe.p_correct([(context.prompt, trace.text)])[0])
        if p < self.threshold:
            return self.verdict(Action.ESCALATE, p, f"P(right) {p:.2f} < {self.threshold:.2f}")
        return self.verdict(Action.CONTINUE, p, f"P(right) {p:.2f}")


def _balanced_threshold(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """The threshold on P(right) whose escalations (below it) best separate wrong from right answers
    out of fold: the highest mean of the share of wrong answers caught and right answers kept."""
    best = (0.5, 0.0)
    for t in np.unique(p):
        kept = p >= t
        score = 0.5 * (float(kept[y].mean()) + float((~kept[~y]).mean()))
        if score > best[1]:
            best = (float(t), score)
    return {"threshold": best[0], "balanced_accuracy": best[1]}
