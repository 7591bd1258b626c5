"""Verifiers that score, stop, prune or escalate generations, in flight (an engine hook) or once final.

- `base`, `compose`, `hook`: verdicts and traces, combining verifiers, the hook the engine calls.
- `degeneration`, `confidence`, `probe`: in-flight early stops and pruning; the answer probe.
- `answers`: final checks (a math number, code tests in the sandbox, structure) that escalate a cascade.
- `policy`: the verifiers a policy asks for, built for a request or for policy tuning.
"""

__all__ = ["answers", "base", "compose", "confidence", "degeneration", "hook", "policy", "probe", "probe_data"]
