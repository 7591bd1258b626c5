"""Complexity router: labels from our own tiers, features, training, calibration and evaluation.

It predicts P(the small tier's answer is good enough) for a conversation; see README "Router".
"""
