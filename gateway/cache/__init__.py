"""The response caches: a request's normalized key (`normalize`), the exact cache in Redis (`exact`), the
semantic cache (`semantic`) with its lexical guards (`guard`) and its threshold's calibration on labeled pairs
(`calibrate`, `data/`), and the pipeline's cache stage over both (`stage`). Imports `gateway.http` only.
"""

__all__ = ["calibrate", "exact", "guard", "normalize", "semantic", "stage"]
