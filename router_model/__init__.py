"""Complexity router: features, training, calibration and evaluation (arrives with the router issue).

Until then every request names its tier directly as the `model` it asks for.
"""
