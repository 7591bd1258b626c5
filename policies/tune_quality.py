"""Quality of one answer for policy tuning, on a 0-1 scale: right or wrong where a check exists (GSM8K's
number, HumanEval's unit tests), else the judge tier's rating.

The judge sees one question and one answer at a time, never which policy wrote it, and rates it 1-9;
the score is the rating's expectation under the judge's next-token distribution over the nine digits
(read from its top log-probabilities), which separates answers far better than the one digit it would
print. 1 maps to 0 and 9 to 1.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping, Sequence

import anyio

from engines.protocol import TierEngine
from engines.request import EngineRequest, FinishReason, RequestOutput, TokenLogprob
from engines.sampling import SamplingParams
from grading.datasets import Item
from grading.graders import grade_gsm8k, grade_humaneval
from grading.sandbox import JailUnavailable
from policies.tuning import Grade, TunePrompt, TuningError

JUDGE_TEMPLATE = """\
You are grading an AI assistant's answer to a user's question.

[Question]
{question}

[Answer]
{answer}

How good is the answer: is it correct, complete and helpful? Rate it from 1 (useless or wrong) to 9 \
(excellent). Reply with the digit only."""
MAX_ANSWER_CHARS = 6000  # the judge's context is finite; an answer longer than this is judged on its start
TOP = 20  # alternatives read from the judge's first token


class _FirstToken:
    """A generation hook that only asks the engine for the top log-probabilities of each token."""

    top_logprobs = TOP

    def observe(self, output: RequestOutput) -> None:
        pass

    def decide(self) -> Mapping[str, FinishReason]:
        return {}


class Judge:
    def __init__(self, engine: TierEngine) -> None:
        self.engine = engine
        digits: dict[int, int] = {}
        for d in range(1, 10):
            ids = engine.tokenizer.encode(str(d), add_special_tokens=False)
            if len(ids) == 1:
                digits[ids[0]] = d
        if len(digits) < 9:
            raise TuningError("the judge's tokenizer does not spell the digits 1-9 as one token each")
        self.digits = digits
        self.unrated = 0  # answers whose rating had to be read from the text, or defaulted to the lowest

    def messages(self, question: str, answer: str) -> list[dict[str, str]]:
        text = answer.strip()[:MAX_ANSWER_CHARS] or "(no answer)"
        return [{"role": "user", "content": JUDGE_TEMPLATE.format(question=question.strip(), answer=text)}]

    def score(self, first: TokenLogprob | None, text: str) -> float:
        mass = {}
        if first is not None:
            for token_id, logprob in first.top:
                if token_id in self.digits:
                    mass[self.digits[token_id]] = math.exp(logprob)
        if mass:
            rating = sum(d * p for d, p in mass.items()) / sum(mass.values())
        else:
            self.unrated += 1
            found = re.search(r"[1-9]", text)
            rating = int(found.group()) if found else 1
        return (rating - 1) / 8

    async def rate(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """Scores for (question, answer) pairs, in order."""
        hook = _FirstToken()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        reqs, room = [], self.engine.max_model_len - 1
        run = uuid.uuid4().hex[:8]  # request ids unique on a live engine
        for i, (question, answer) in enumerate(pairs):
            ids = self.engine.tokenizer.encode_chat(self.messages(question, answer))
            if len(ids) > room:  # too long even after the character cut: keep the template's end
                ids = ids[:64] + ids[-(room - 64) :]
            reqs.append(EngineRequest(f"judge-{run}-{i}", ids, params, priority=10, hook=hook))
        firsts: dict[str, TokenLogprob | None] = {}
        texts: dict[str, str] = {}
        async with self.engine.open(reqs) as stream:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    raise TuningError(f"the judge failed: {out.error}")
                if out.logprobs and out.request_id not in firsts:
                    firsts[out.request_id] = out.logprobs[0]
                texts[out.request_id] = texts.get(out.request_id, "") + out.text
        return [self.score(firsts.get(r.request_id), texts.get(r.request_id, "")) for r in reqs]


def grader(judge: Judge | None) -> Grade:
    """Grades for (prompt, answer) pairs: checks where the prompt has one, the judge for the rest."""

    async def grade(pairs: Sequence[tuple[TunePrompt, str]]) -> list[float]:
        out: list[float | None] = [None] * len(pairs)
        judged = [i for i, (p, _) in enumerate(pairs) if p.grader == "judge"]
        for i, (p, text) in enumerate(pairs):
            if p.grader == "gsm8k":
                out[i] = float(grade_gsm8k(_item(p), text))
            elif p.grader == "humaneval":  # runs the answer's code in the sandbox: off the event loop
                try:
                    out[i] = float(await anyio.to_thread.run_sync(grade_humaneval, _item(p), text))
                except JailUnavailable as exc:
                    raise TuningError(f"HumanEval grading needs the code jail: {exc}") from exc
            elif p.grader != "judge":
                raise TuningError(f"unknown grader {p.grader!r}")
        if judged:
            if judge is None:
                raise TuningError("open-ended prompts need a judge tier")
            scores = await judge.rate([(pairs[i][0].question, pairs[i][1]) for i in judged])
            for i, score in zip(judged, scores, strict=True):
                out[i] = score
        return [float(q) for q in out]  # type: ignore[arg-type]

    return grade


def _item(p: TunePrompt) -> Item:
    return Item(p.id, p.grader, p.messages, dict(p.grading))
