"""Complexity router: labels from our own tiers, features, training, calibration and evaluation.

It predicts P(the small tier's answer is good enough) for a conversation; see docs/router.md.
"""

__all__ = [
    "calibrate",
    "calibrate_tenant",
    "drift",
    "encoder",
    "evaluate",
    "examples",
    "features",
    "label",
    "label_store",
    "model",
    "quality",
    "routed_prompts",
    "serving",
    "synthetic",
    "train",
]
