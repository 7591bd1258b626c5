"""The mixed trace `bench.savings` replays: seeded, multi-tenant, bursty, every request gradable.

`build_trace(pools, n, seed)` is pure (no I/O, no clock): the same pools and seed give the same trace.
`load_pools(home)` reads the shipped data sets (`grading.datasets`) and adds the held-out short facts
(`grading.facts.HELD_OUT`), whose reference answers grade by containment.

The mix, by request (repeats included), from exact quotas so the shares hold at any size:
GSM8K 35% (at least a third), HumanEval 27% (at least a quarter), short facts 18%, MT-bench first
turns 12%, chat openers 8%. About `repeat_share` (default 0.3, never above `MAX_REPEAT_SHARE`) of the
requests ask an earlier request's question again, mostly for the same tenant (the response cache is
per tenant): an exact `repeat`; a `respace` (whitespace only: `gateway.cache.normalize` folds it, so it is
the same cache key); or a `paraphrase` (a "Please," prefix, a changed case or a punctuation change:
another exact key, a semantic cache's business). Each variant is checked against
`gateway.cache.normalize.normalize_text` as it is made. Three tenants (`TENANTS`) with their weights;
arrivals come in bursts of 5-40 requests (Poisson around `burst_mean`), bursts apart by exponential gaps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grading.datasets import ANSWER_TOKENS, Item, user
from grading.facts import FACT_INSTRUCTION, HELD_OUT

SHARES = {"gsm8k": 0.35, "humaneval": 0.27, "fact": 0.18, "mtbench": 0.12, "chat": 0.08}
MAX_TOKENS = {"gsm8k": 320, "humaneval": 384, "fact": ANSWER_TOKENS["fact"], "mtbench": 256, "chat": 128}
TENANTS = {"saver": 0.4, "balanced": 0.35, "quality": 0.25}  # name → share of the originals
MAX_REPEAT_SHARE = 0.4
BURST_MIN, BURST_MAX = 5, 40
VARIANTS = {"repeat": 0.4, "respace": 0.25, "paraphrase": 0.35}


def fact_items() -> list[Item]:
    """Short factual questions whose reference answers grade by containment (`grading.facts.grade_fact`):
    the held-out set, which shares no subject with the router's fact labels."""
    return [
        Item(f"fact/{i}", "fact", user(f"{q} {FACT_INSTRUCTION}"), {"answer": a}) for i, (q, a) in enumerate(HELD_OUT)
    ]


def load_pools(home: Path) -> dict[str, list[Item]]:
    """Every shipped item by source (fetched into `home` on first use), plus the facts."""
    from grading.datasets import load_items

    pools: dict[str, list[Item]] = {s: [] for s in SHARES}
    for item in load_items(home, ("gsm8k", "humaneval", "mtbench", "chat")):
        pools[item.source].append(item)
    pools["fact"] = fact_items()
    return pools


@dataclass(frozen=True)
class Request:
    index: int  # position in the trace = order of arrival
    tenant: str
    at: float  # seconds after the trace starts
    burst: int
    source: str
    item_id: str  # the shipped item it asks (a repeat asks its original's)
    kind: str  # original | repeat | respace | paraphrase
    of: int | None  # the index of the original a variant asks again
    messages: list[dict[str, str]]
    grading: dict[str, str] = field(default_factory=dict)
    max_tokens: int = 256

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]

    def item(self) -> Item:
        return Item(self.item_id, self.source, self.messages, self.grading)


def quotas(n: int, shares: dict[str, float]) -> dict[str, int]:
    """Counts per source summing to n, by largest remainder."""
    raw = {s: n * w / sum(shares.values()) for s, w in shares.items()}
    counts = {s: math.floor(v) for s, v in raw.items()}
    for s in sorted(raw, key=lambda s: raw[s] - counts[s], reverse=True)[: n - sum(counts.values())]:
        counts[s] += 1
    return counts


def _same(a: str, b: str) -> bool:
    from gateway.cache.normalize import normalize_text

    return normalize_text(a, masks=()) == normalize_text(b, masks=())


def respace(text: str, rng: random.Random) -> str | None:
    """Whitespace the gateway folds: doubled spaces in the first line, trailing spaces, a trailing newline."""
    head, sep, tail = text.partition("\n")
    words = head.split(" ")
    if len(words) > 2:
        i = rng.randrange(1, len(words))
        words[i] = " " + words[i]
    variant = " ".join(words) + "  " + sep + tail + "\n"
    return variant if variant != text and _same(variant, text) else None


def paraphrase(text: str, rng: random.Random) -> str:
    """A small change that is not the same cache key: a polite prefix, a changed case, or punctuation."""
    head, sep, tail = text.partition("\n")
    choice = rng.randrange(4)
    if choice == 0:
        head = "Please, " + head[:1].lower() + head[1:]
    elif choice == 1:
        head = "please " + head
    elif choice == 2:
        head = head[:1].swapcase() + head[1:] if head[:1].isalpha() else "Please, " + head
    elif head.endswith(("?", ".")):
        head = head[:-1] + ("!" if head.endswith(".") else " ?")
    else:
        head += "!"
    variant = head + sep + tail
    return variant if not _same(variant, text) else "Please, " + text


def _variant(original: Request, rng: random.Random) -> tuple[str, list[dict[str, str]]]:
    kind = rng.choices(list(VARIANTS), weights=list(VARIANTS.values()))[0]
    text = original.question
    if kind == "respace":
        changed = respace(text, rng)
        if changed is None:
            return "repeat", original.messages
        return kind, [*original.messages[:-1], {"role": "user", "content": changed}]
    if kind == "paraphrase":
        return kind, [*original.messages[:-1], {"role": "user", "content": paraphrase(text, rng)}]
    return "repeat", original.messages


def poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def burst_sizes(n: int, rng: random.Random, mean: float) -> list[int]:
    """Sizes within [BURST_MIN, BURST_MAX] summing to n (one burst when n is smaller than BURST_MIN)."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(BURST_MAX, max(BURST_MIN, poisson(rng, mean))))
    sizes[-1] -= sum(sizes) - n
    if len(sizes) > 1 and sizes[-1] < BURST_MIN:
        short = BURST_MIN - sizes[-1]
        if sizes[-2] + sizes[-1] <= BURST_MAX:
            last = sizes.pop()
            sizes[-1] += last
        else:
            sizes[-2], sizes[-1] = sizes[-2] - short, BURST_MIN
    return sizes


def arrivals(n: int, rng: random.Random, burst_mean: float, gap_s: float, spread_s: float) -> list[tuple[int, float]]:
    """(burst, seconds) per request, in order: a burst's requests arrive within `spread_s` of its start, and
    bursts are apart by `spread_s` plus an exponential gap of mean `gap_s`."""
    out: list[tuple[int, float]] = []
    start = 0.0
    for b, size in enumerate(burst_sizes(n, rng, burst_mean)):
        if b:  # the next burst starts once the last one has arrived, after a quiet gap
            start += spread_s + rng.expovariate(1 / gap_s)
        out += [(b, round(start + t, 4)) for t in sorted(rng.uniform(0, spread_s) for _ in range(size))]
    return out


def build_trace(
    pools: dict[str, Sequence[Item]],
    n: int = 800,
    seed: int = 0,
    *,
    repeat_share: float = 0.3,
    burst_mean: float = 15.0,
    gap_s: float = 3.0,
    spread_s: float = 1.0,
    max_tokens: int | None = None,
) -> list[Request]:
    """n requests; see the module docstring. `max_tokens` caps every source's completion budget."""
    if not 0 <= repeat_share <= MAX_REPEAT_SHARE:
        raise ValueError(f"repeat_share must be within [0, {MAX_REPEAT_SHARE}]")
    rng = random.Random(seed)
    slots = [s for s, k in quotas(n, SHARES).items() for _ in range(k)]
    rng.shuffle(slots)
    order = {s: rng.sample(list(pools[s]), len(pools[s])) for s in SHARES}
    times = arrivals(n, rng, burst_mean, gap_s, spread_s)
    tenants, weights = list(TENANTS), list(TENANTS.values())
    trace: list[Request] = []
    originals: dict[str, list[Request]] = {s: [] for s in SHARES}
    for i, source in enumerate(slots):
        burst, at = times[i]
        earlier = originals[source]
        fresh = len(earlier) < len(order[source])
        if earlier and (not fresh or rng.random() < repeat_share):
            first = rng.choice(earlier)
            tenant = first.tenant if rng.random() < 0.8 else rng.choice(tenants)
            kind, messages = _variant(first, rng)
            request = Request(i, tenant, at, burst, source, first.item_id, kind, first.index, messages,
                              first.grading, first.max_tokens)  # fmt: skip
        elif fresh:
            item = order[source][len(earlier)]
            budget = min(MAX_TOKENS[source], max_tokens or MAX_TOKENS[source])
            tenant = rng.choices(tenants, weights)[0]
            request = Request(i, tenant, at, burst, source, item.id, "original", None, item.messages,
                              dict(item.grading), budget)  # fmt: skip
            earlier.append(request)
        else:
            raise ValueError(f"no {source} items to ask: its pool is empty")
        trace.append(request)
    if (share := sum(r.kind != "original" for r in trace) / max(1, n)) > MAX_REPEAT_SHARE:
        raise ValueError(f"{share:.0%} of the requests repeat an earlier one (pools too small for n={n})")
    return trace


def summary(trace: Sequence[Request]) -> dict[str, object]:
    """Shares by source, kind and tenant; bursts; what a perfect per-tenant exact cache could hit."""
    n = max(1, len(trace))
    bursts = Counter(r.burst for r in trace)
    same_key = sum(r.kind in ("repeat", "respace") and trace[r.of or 0].tenant == r.tenant for r in trace)
    return {
        "requests": len(trace),
        "sources": {k: round(v / n, 4) for k, v in sorted(Counter(r.source for r in trace).items())},
        "kinds": dict(sorted(Counter(r.kind for r in trace).items())),
        "tenants": dict(sorted(Counter(r.tenant for r in trace).items())),
        "repeat_share": round(sum(r.kind != "original" for r in trace) / n, 4),
        "exact_hit_ceiling": round(same_key / n, 4),
        "bursts": len(bursts),
        "burst_sizes": [min(bursts.values(), default=0), max(bursts.values(), default=0)],
        "duration_s": trace[-1].at if trace else 0.0,
    }
