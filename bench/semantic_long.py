"""The semantic cache on texts longer than MiniLM reads (256 word pieces): four ways to judge them, measured.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.semantic_long [--per-kind 30] [--seed 0]

Labeled long pairs, built from the shipped held-out text (answers of 300-900 words, as documents) and the
shipped question pairs (`gateway/cache/data/semantic_pairs.jsonl`):
- a long document, then a question reworded (an equivalent pair): must hit;
- the same document re-sent with only politeness changed after it ("Thanks!"): must hit;
- a long document, then another question (a differing pair): must not;
- a needle past the window (the issue's case): 600 words without a sentence end, then one word or 200 more
  words and another, then the same question: must not;
- a comma-separated list with items appended past the window, the same question after it: must not;
- a document with a sentence changed past the window, the same question after it: must not.
Each pair has passed the whole-text similarity (the cache's candidate search) or it counts as a miss.
The ways: `truncated` (before: the first window's embedding, the guards, the sentence frame rule),
`windows` (every aligned window of 150 words must pass, the same number of them), `differing` (shipped:
what differs, by sentences else by words, must fit the window and pass; `frame_similarity`), `exact` (a
long text hits only exactly). Per kind, the share that hit; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from pathlib import Path

import numpy as np

from bench.common import say
from core.embedder import Embedder
from gateway.cache.calibrate import load_pairs
from gateway.cache.guard import _NEGATION, _NUMBER_WORD, differing_sentences, guard, only_framing_differs
from gateway.cache.semantic import DEFAULT_THRESHOLD, frame_similarity

WINDOW_WORDS = 150  # about 200 word pieces: a window MiniLM reads whole


def documents(rng: random.Random, home: Path, n: int) -> list[str]:
    from grading.datasets import heldout_text

    paragraphs = [p for p in heldout_text(home, progress=False).split("\n\n") if len(p.split()) > 20]
    out = []
    while len(out) < n:
        start = rng.randrange(len(paragraphs))
        doc, words = [], 0
        for p in paragraphs[start:]:
            doc.append(p)
            words += len(p.split())
            if words >= rng.randint(300, 900):
                break
        if words >= 300:
            out.append("\n\n".join(doc))
    return out


def build(rng: random.Random, home: Path, per_kind: int) -> list[tuple[str, str, str, bool]]:
    """(kind, a, b, must hit)."""
    pairs = load_pairs()
    same = [p for p in pairs if p[2]]
    differ = [p for p in pairs if not p[2]]
    docs = documents(rng, home, 3 * per_kind)
    # Words no guard reads (no number words, no negation): the long runs must differ only where MiniLM is blind.
    words = re.findall(r"[a-z]+", " ".join(docs).lower())
    words = [w for w in words if not _NUMBER_WORD.match(w) and not _NEGATION.match(w)]
    out = []
    question = "What is the last word of the text above?"
    for i in range(per_kind):
        doc = docs[i]
        qa, qb, _ = rng.choice(same)
        out.append(("reworded question after a document", f"{doc}\n\n{qa}", f"{doc}\n\n{qb}", True))
        out.append(("the document re-sent, politeness changed", f"{doc}\n\n{qa}", f"{doc}\n\n{qa} Thanks!", True))
        qa, qb, _ = rng.choice(differ)
        out.append(("another question after a document", f"{doc}\n\n{qa}", f"{doc}\n\n{qb}", False))
        run = " ".join(rng.choice(words) for _ in range(600))
        more = " ".join(rng.choice(words) for _ in range(200))
        w1, w2 = rng.sample(words, 2)
        out.append(("a needle past the window", f"{run} {w1} {question}", f"{run} {more} {w2} {question}", False))
        items = ", ".join(rng.choice(words) for _ in range(300))
        extra = ", ".join(rng.choice(words) for _ in range(20))
        ask = "Which of these items appears most often?"
        out.append(("items appended past the window", f"{items}\n{ask}", f"{items}, {extra}\n{ask}", False))
        sentences = re.split(r"(?<=[.!?])\s+", docs[per_kind + i])
        other = re.split(r"(?<=[.!?])\s+", docs[2 * per_kind + i])
        changed = [*sentences[:-1], rng.choice(other)] if len(sentences) > 2 else sentences
        a, b = " ".join(sentences), " ".join(changed)
        out.append(("a sentence changed past the window", f"{a}\n\n{question}", f"{b}\n\n{question}", False))
    return out


def truncated(e: Embedder, a: str, b: str, t: float) -> bool:
    """The rule before: the guards, and the sentence frame's similarity (whole-text vectors, first window)."""
    if guard(a, b) is not None:
        return False
    parts = differing_sentences(a, b)
    if parts is None:
        return True
    x, y = parts
    if only_framing_differs(x, y):
        return True
    if not x or not y:
        return False
    vx, vy = e.encode([x, y])
    return float(vx @ vy) >= t


def windows(e: Embedder, a: str, b: str, t: float) -> bool:
    if guard(a, b) is not None:
        return False
    wa, wb = a.split(), b.split()
    ca = [" ".join(wa[i : i + WINDOW_WORDS]) for i in range(0, len(wa), WINDOW_WORDS)]
    cb = [" ".join(wb[i : i + WINDOW_WORDS]) for i in range(0, len(wb), WINDOW_WORDS)]
    if len(ca) != len(cb):
        return False
    va, vb = e.encode(ca), e.encode(cb)
    return bool(((va * vb).sum(axis=1) >= t).all())


def differing(e: Embedder, a: str, b: str, t: float) -> bool:
    if guard(a, b) is not None:
        return False
    local = frame_similarity(e, a, b)
    return local is None or local >= t


def exact(e: Embedder, a: str, b: str, t: float) -> bool:
    if not (e.fits(a) and e.fits(b)):
        return a == b
    return differing(e, a, b, t)


WAYS = {"truncated": truncated, "windows": windows, "differing": differing, "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.semantic_long", description=__doc__.split("\n\n")[0])
    p.add_argument("--per-kind", type=int, default=30, help="pairs of each kind (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--home", type=Path, default=Path(os.environ.get("SWITCHBOARD_HOME", "~/.cache/switchboard")))
    args = p.parse_args()
    e, t = Embedder(), DEFAULT_THRESHOLD
    rows = build(random.Random(args.seed), args.home.expanduser(), args.per_kind)
    long_share = float(np.mean([not (e.fits(a) and e.fits(b)) for _, a, b, _ in rows]))
    va, vb = e.encode([r[1] for r in rows]), e.encode([r[2] for r in rows])
    candidate = (va * vb).sum(axis=1) >= t  # what the cache's search would even consider
    kinds = list(dict.fromkeys(r[0] for r in rows))
    result: dict[str, object] = {"pairs": len(rows), "threshold": t, "longer_than_window": round(long_share, 3)}
    table: dict[str, dict[str, float]] = {}
    for way, judge in WAYS.items():
        hits = [bool(c) and judge(e, a, b, t) for c, (_, a, b, _) in zip(candidate, rows, strict=True)]
        table[way] = {k: round(float(np.mean([h for h, r in zip(hits, rows, strict=True) if r[0] == k])), 3)
                      for k in kinds}  # fmt: skip
        same = [h for h, r in zip(hits, rows, strict=True) if r[3]]
        differ = [h for h, r in zip(hits, rows, strict=True) if not r[3]]
        table[way] |= {"true_hit_rate": round(float(np.mean(same)), 3),
                       "false_hit_rate": round(float(np.mean(differ)), 3)}  # fmt: skip
        say(f"{way:>10}: true hits {table[way]['true_hit_rate']:.3f}, false hits {table[way]['false_hit_rate']:.3f}")
    say("\n" + "kind".ljust(42) + "".join(w.rjust(11) for w in WAYS))
    for k in [*kinds, "true_hit_rate", "false_hit_rate"]:
        say(k.ljust(42) + "".join(f"{table[w][k]:>11.3f}" for w in WAYS))
    result["candidates"] = round(float(candidate.mean()), 3)
    result["ways"] = table
    print(json.dumps(result))


if __name__ == "__main__":
    main()
