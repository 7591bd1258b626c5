"""Verifiers on their own: verdicts, composition as documented, degeneration detection."""

from __future__ import annotations

from pathlib import Path

import pytest
from answer_samples import apple_answers

from engines.request import TokenLogprob
from verifiers.answers import CodeTests, MathAnswer, Structure
from verifiers.base import NOT_CHECKED, Action, Context, Trace, TraceVerifier, Verdict
from verifiers.compose import all_of, any_of, weighted
from verifiers.confidence import Confidence, token_confidence
from verifiers.degeneration import Degeneration, repeating_tail

CTX = Context(prompt="Tell me about cats.")


class Fixed(TraceVerifier):
    """Answers every trace with one verdict (a test double for composition)."""

    def __init__(self, name: str, action: Action, score: float, every: int = 0) -> None:
        self.name, self.action, self.score, self.every = name, action, score, every

    def check_trace(self, context: Context, trace: Trace) -> Verdict:
        return self.verdict(self.action, self.score, f"{self.name} says {self.action}")


def done(tokens: list[int] | None = None, text: str = "") -> Trace:
    return Trace(0, list(tokens or [1, 2, 3]), text, finished=True, finish_reason="stop")


def test_repeating_tail_finds_the_loop_and_its_period() -> None:
    assert repeating_tail([5, 6, 7, 8], 8) == (0, 0)
    assert repeating_tail([9] + [1] * 10, 8) == (1, 10)
    assert repeating_tail([9, 8] + [1, 2, 3] * 5, 8) == (3, 15)
    # the shortest period among equally long tails: (1 2)x4 is also (1 2 1 2)x2
    assert repeating_tail([7, 1, 2, 1, 2, 1, 2, 1, 2], 8) == (2, 8)


def test_degeneration_stops_loops_and_runaway_lists_only() -> None:
    v = Degeneration(min_tokens=12, min_repeats=3)
    sentence = list(range(100, 108))  # an 8-token sentence said again and again
    looping = done(list(range(20)) + sentence * 4)
    verdict = v.check(CTX, [looping])[0]
    assert verdict.action is Action.STOP and "every 8 tokens" in verdict.reason and 0 < verdict.score < 1
    assert v.check(CTX, [done(list(range(20)) + sentence * 2)])[0].action is Action.CONTINUE  # said twice: fine
    varied = done(list(range(200)))
    assert v.check(CTX, [varied])[0] == Verdict(Action.CONTINUE, 1.0, "", "degeneration")
    many = "\n".join(f"- item {i}" for i in range(70))
    assert v.check(CTX, [done(text=many)])[0].action is Action.STOP
    same = "Intro\n" + "\n".join(["Yes, I can help."] * 6)
    assert v.check(CTX, [done(text=same)])[0].action is Action.STOP


def test_in_flight_verifiers_look_every_n_tokens_even_when_steps_add_several() -> None:
    v = Degeneration(every=16)
    trace = Trace(0)
    looked = []
    for step in range(12):
        trace.token_ids += [step, step + 1, step + 2]  # a speculative step adds 3 tokens at a time
        if v.check(CTX, [trace])[0] is not NOT_CHECKED:
            looked.append(trace.num_tokens)
    assert looked == [18, 36]  # 16 tokens or more since the last look, never skipped


def test_composition_as_documented() -> None:
    stop = Fixed("s", Action.STOP, 0.9)
    prune = Fixed("p", Action.PRUNE, 0.2)
    ok = Fixed("ok", Action.CONTINUE, 0.8)
    escalate = Fixed("e", Action.ESCALATE, 0.1)
    assert any_of(ok, stop, prune).check(CTX, [done()])[0].verifier == "p"  # the most drastic wins
    assert any_of(ok, stop, prune).check(CTX, [done()])[0].action is Action.PRUNE
    assert any_of(escalate, prune).check(CTX, [done()])[0].action is Action.ESCALATE
    assert any_of(ok, Fixed("ok2", Action.CONTINUE, 0.5)).check(CTX, [done()])[0].action is Action.CONTINUE
    # all: only if every member asks for an action; then the mildest, with the lowest score
    assert all_of(stop, ok).check(CTX, [done()])[0].action is Action.CONTINUE
    both = all_of(stop, prune).check(CTX, [done()])[0]
    assert both.action is Action.STOP and both.score == 0.2 and "s:" in both.reason and "p:" in both.reason
    # weighted: (0.9*1 + 0.2*3) / 4 = 0.375 < 0.5 -> the configured action
    w = weighted((stop, 1.0), (prune, 3.0), threshold=0.5, action=Action.ESCALATE).check(CTX, [done()])[0]
    assert w.action is Action.ESCALATE and w.score == pytest.approx(0.375)
    assert weighted((stop, 3.0), (prune, 1.0), threshold=0.5).check(CTX, [done()])[0].action is Action.CONTINUE
    with pytest.raises(ValueError):
        weighted((stop, 0.0))


def test_weighted_ignores_members_that_did_not_look() -> None:
    late = Fixed("late", Action.CONTINUE, 0.0, every=0)  # final-only: silent while the trace runs
    eager = Fixed("eager", Action.CONTINUE, 0.9, every=4)
    combined = weighted((late, 1.0), (eager, 1.0), threshold=0.5)
    assert combined.every == 4
    running = Trace(0, [1, 2, 3, 4])
    assert combined.check(CTX, [running])[0].score == pytest.approx(0.9)  # only the eager one looked
    assert combined.check(CTX, [done([1, 2, 3, 4, 5])])[0].action is Action.ESCALATE  # both: 0.45


def _trace(index: int, n: int, sure: bool, text: str = "", finished: bool = False) -> Trace:
    """A trace of n tokens whose top-5 alternatives are peaked (sure) or flat (unsure)."""
    top = ((1, -0.01), (2, -7.0), (3, -8.0), (4, -9.0), (5, -10.0)) if sure else tuple((i, -1.6) for i in range(5))
    lps = [TokenLogprob(1, top[0][1], top) for _ in range(n)]
    return Trace(index, [1] * n, text, lps, finished=finished, finish_reason="stop" if finished else None)


def test_confidence_scores_peaked_distributions_higher() -> None:
    assert token_confidence(((1, -0.01), (2, -7.0))) > token_confidence(((1, -0.7), (2, -0.7)))


def test_confidence_stops_the_rest_once_the_vote_has_converged() -> None:
    v = Confidence(every=8, window=8, min_votes=3, consensus=0.95)
    answer = "So she has 18 apples. The answer is 18."
    finished = [_trace(i, 40, True, answer, finished=True) for i in range(3)]
    running = [_trace(i, 40, True) for i in range(3, 8)]
    verdicts = v.check(CTX, finished + running)
    assert [d.action for d in verdicts[3:]] == [Action.STOP] * 5 and "'18'" in verdicts[3].reason
    assert all(d.action is Action.CONTINUE for d in verdicts[:3])
    # split votes do not stop anything
    split = [_trace(0, 40, True, "The answer is 18.", True), _trace(1, 40, True, "The answer is 20.", True)]
    split += [_trace(2, 40, True, "The answer is 18.", True)] + [_trace(i, 40, True) for i in range(3, 8)]
    assert all(d.action is not Action.STOP for d in Confidence(every=8, window=8).check(CTX, split))
    # the rest cannot overturn 5 equal answers: stopped even below the consensus share
    lead = [_trace(i, 40, True, "The answer is 7.", True) for i in range(5)]
    lead += [_trace(5, 40, True, "The answer is 9.", True), _trace(6, 40, True), _trace(7, 40, True)]
    verdicts = Confidence(every=8, window=8, consensus=0.99).check(CTX, lead)
    assert [d.action for d in verdicts[6:]] == [Action.STOP, Action.STOP]


def test_confidence_prunes_the_least_confident_but_keeps_a_minimum() -> None:
    traces = [_trace(0, 64, True), _trace(1, 64, False), _trace(2, 64, True), _trace(3, 64, False)]
    verdicts = Confidence(every=16, window=16, prune_quantile=0.4, min_keep=2).check(CTX, traces)
    assert [d.action for d in verdicts] == [Action.CONTINUE, Action.PRUNE, Action.CONTINUE, Action.PRUNE]
    assert verdicts[1].score < verdicts[0].score
    few = [_trace(0, 64, True), _trace(1, 64, False)]
    assert all(d.action is Action.CONTINUE for d in Confidence(window=16, min_keep=2).check(CTX, few))
    # an absolute threshold (calibrated offline) prunes a lone unsure trace too
    lone = [_trace(0, 64, False), _trace(1, 64, True), _trace(2, 64, True)]
    verdicts = Confidence(window=16, threshold=3.0, min_keep=1).check(CTX, lone)
    assert verdicts[0].action is Action.PRUNE and verdicts[1].action is Action.CONTINUE


def test_answer_checks_escalate_what_fails() -> None:
    math = MathAnswer()
    assert math.check(CTX, [done(text="So the total is 18.")])[0].action is Action.CONTINUE
    assert math.check(CTX, [done(text="I cannot tell.")])[0].action is Action.ESCALATE
    graded = Context(prompt="q", reference="She pays 3 + 15 = 18.\n#### 18")
    assert math.check(graded, [done(text="The answer is 18.00")])[0].action is Action.CONTINUE
    assert math.check(graded, [done(text="The answer is 17.")])[0].action is Action.ESCALATE

    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    code = CodeTests(timeout=5)
    right = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code.check(Context(tests=tests), [done(text=right)])[0].action is Action.CONTINUE
    failed = code.check(Context(tests=tests), [done(text=wrong)])[0]
    assert failed.action is Action.ESCALATE and "AssertionError" in failed.reason
    hostile = (
        "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 6379))\ndef add(a, b):\n    return a + b\n```"
    )
    assert code.check(Context(tests=tests), [done(text=hostile)])[0].action is Action.ESCALATE  # the sandbox said no

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_schema = Context(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    structure = Structure()
    assert structure.check(as_schema, [done(text='{"n": 3}')])[0].action is Action.CONTINUE
    assert structure.check(as_schema, [done(text='{"n": "three"}')])[0].action is Action.ESCALATE
    assert structure.check(as_schema, [done(text='{"n": 3')])[0].action is Action.ESCALATE  # cut off
    as_object = Context(response_format={"type": "json_object"})
    assert structure.check(as_object, [done(text="[1, 2]")])[0].action is Action.ESCALATE
    as_regex = Context(response_format={"type": "regex", "regex": "(yes|no)"})
    assert structure.check(as_regex, [done(text="yes")])[0].action is Action.CONTINUE
    assert structure.check(as_regex, [done(text="yes!")])[0].action is Action.ESCALATE
    assert structure.check(CTX, [done(text="anything")])[0].action is Action.CONTINUE


def test_the_probe_learns_round_trips_and_escalates(tmp_path: Path) -> None:
    from router_model.encoder import RouterEncoder
    from verifiers.probe import AnswerProbe, ProbeCheck

    pairs, labels = apple_answers()
    encoder = RouterEncoder()
    probe = AnswerProbe.train(pairs, labels, encoder)
    assert probe.metadata["cv_auc"] > 0.9 and probe.metadata["n_train"] == 80
    again = AnswerProbe.load(probe.save(tmp_path / "probe"), encoder)
    q = "Sara has 5 pens and buys 8 more. How many pens does she have?"
    good, bad = "5 + 8 = 13. The answer is 13.", "pens pens pens, I am not sure"
    p_good, p_bad = again.p_correct([(q, good), (q, bad)])
    assert p_good > 0.5 > p_bad
    check = ProbeCheck(again)
    ctx = Context(prompt=q)
    assert check.check(ctx, [done(text=bad)])[0].action is Action.ESCALATE
    assert check.check(ctx, [done(text=good)])[0].action is Action.CONTINUE
