"""Verifiers that score, stop, prune or escalate generations, in flight (an engine hook) or once final.

- `base`, `compose`, `hook`: verdicts and traces, combining verifiers, the hook the engine calls.
- `degeneration`, `confidence`, `probe`: in-flight early stops and pruning; the answer probe.
- `answers`: final checks (a math number, code tests in the sandbox, structure) that escalate a cascade.
- `prompt_examples`, `agreement`: final checks per kind of request: a code answer against its prompt's
  examples; a math answer against the same tier's program (`program_of_thought`) or second sample.
- `ask`: how final checks ask the serving tier a question of their own (`Context.ask`).
- `policy`: the verifiers a policy asks for, built for a request or for policy tuning.
"""

__all__ = [
    "agreement",
    "answers",
    "ask",
    "base",
    "compose",
    "confidence",
    "degeneration",
    "hook",
    "policy",
    "probe",
    "probe_data",
    "prompt_examples",
]
