"""The tiny random-weight models of every family (`bench.tiny_models`), for the engine tests."""

from bench.tiny_models import FAMILY_DEFAULTS, VOCAB, tiny_hf_model

__all__ = ["FAMILY_DEFAULTS", "VOCAB", "tiny_hf_model"]
