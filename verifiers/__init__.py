"""Verifiers that score, stop, prune or escalate generations (arrive with the verifiers issue)."""
