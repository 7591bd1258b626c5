"""Synthetic labeled prompts with a learnable signal, for tests and the benchmark's smoke run.

Real labels come from `switchboard router label` (an hour of both tiers). These imitate their sources
and their shape: the small tier fails on long, many-step math and on long, many-requirement code
tasks, and passes on short chat; the large tier passes more often; a share of labels is flipped at
random so nothing is perfectly separable. Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from router_model.examples import Example

_NAMES = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lena", "Mo"]
_ITEMS = ["apples", "books", "marbles", "stickers", "cookies", "pencils", "shells", "coins", "cards", "plants"]
_VERBS = ["buys", "sells", "gives away", "finds", "loses", "bakes", "collects", "trades"]
_TASKS = [
    "reverses a string", "returns the n-th Fibonacci number", "checks whether a number is prime",
    "merges two sorted lists", "counts the vowels in a word", "parses a CSV line into fields",
    "flattens a nested list", "finds the longest common prefix", "validates an email address",
    "computes a moving average", "groups anagrams", "implements an LRU cache", "balances parentheses",
    "converts Roman numerals to integers", "finds all permutations of a list", "serializes a binary tree",
]  # fmt: skip
_CONSTRAINTS = [
    "Handle empty input.", "Run in O(n log n) time.", "Do not use the standard library's sort.",
    "Raise ValueError on invalid input.", "Support unicode.", "Use constant extra memory.",
    "Include type hints.", "Make it thread-safe.", "Process the input as a stream.", "Return a generator.",
]  # fmt: skip
_LANGS = ["Python", "JavaScript", "Rust", "Go", "Java", "C++"]
_CHAT = [
    "Hi! How are you today?", "What's the capital of France?", "Tell me a fun fact about cats.",
    "Who wrote Romeo and Juliet?", "Can you recommend a good book?", "What does HTTP stand for?",
    "Say hello in Spanish.", "What color is the sky?", "Thanks for your help!", "What is your name?",
    "Translate 'good morning' to German.", "Give me a synonym for happy.", "What day comes after Monday?",
    "Is a tomato a fruit?", "Name a famous painter.", "What's a good name for a dog?",
]  # fmt: skip
_ESSAYS = [
    "the history of the printing press", "renewable energy policy", "the ethics of artificial intelligence",
    "urban planning in dense cities", "the causes of the French Revolution", "remote work and productivity",
    "the role of central banks", "ocean acidification", "the philosophy of free will", "supply chain resilience",
]  # fmt: skip
_FORMATS = ["as a JSON object", "as a table", "as a numbered list", "in exactly 3 bullet points", "in under 50 words"]


def _math(rng: random.Random) -> tuple[str, int]:
    steps = rng.randint(1, 7)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    parts = [f"{name} has {rng.randint(5, 400)} {item}."]
    for _ in range(steps - 1):
        parts.append(f"Then {name} {rng.choice(_VERBS)} {rng.randint(2, 90)} {item}.")
    if steps > 3:
        parts.append(f"Each week this repeats {rng.randint(2, 12)} times and {rng.randint(5, 40)}% are lost.")
    parts.append(f"How many {item} does {name} have at the end? Solve it step by step.")
    return " ".join(parts), steps


def _code(rng: random.Random) -> tuple[str, int]:
    hard = rng.randint(0, 5)
    lang, task = rng.choice(_LANGS), rng.choice(_TASKS)
    text = f"Write a {lang} function that {task}."
    if hard:
        text += " " + " ".join(rng.sample(_CONSTRAINTS, hard))
    if hard > 2:
        text += f"\n\n```{lang.lower()}\ndef solve(data):\n    # your code here\n    pass\n```\nAlso write unit tests."
    return text, hard


def _chat(rng: random.Random) -> tuple[str, int]:
    return rng.choice(_CHAT), 0


def _essay(rng: random.Random) -> tuple[str, int]:
    depth = rng.randint(0, 4)
    text = f"Write about {rng.choice(_ESSAYS)}"
    if depth:
        text += f", {rng.choice(_FORMATS)}"
    if depth > 1:
        text += ". Compare at least three viewpoints, cite evidence for each and explain why they disagree"
    if depth > 2:
        text += ". Then analyze the long-term consequences and propose a policy with its trade-offs"
    return text + ".", depth


_SOURCES = {"gsm8k": (_math, 3), "humaneval": (_code, 2), "chat": (_chat, 99), "mtbench": (_essay, 2)}


def synthetic_examples(
    n: int, seed: int = 0, sources: Sequence[str] = tuple(_SOURCES), noise: float = 0.1
) -> list[Example]:
    """n examples, sources in turn; small_ok is False past each source's difficulty limit, 10% flipped."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        source = sources[i % len(sources)]
        make, limit = _SOURCES[source]
        text, difficulty = make(rng)
        small_ok = difficulty <= limit
        large_ok = difficulty <= limit + 3 or rng.random() < 0.5
        if rng.random() < noise:
            small_ok = not small_ok
        if rng.random() < noise / 2:
            large_ok = not large_ok
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.2:  # some conversations carry a system prompt or an earlier turn
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        out.append(Example(f"{source}/{seed}-{i}", source, small_ok, large_ok, messages))
    return out


def write_label_file(examples: Sequence[Example], path: Path) -> Path:
    """A label file in `switchboard router label`'s shape, each row carrying its messages."""
    with open(path, "w", encoding="utf-8") as f:
        for e in examples:
            row = {"id": e.id, "source": e.source, "small_ok": e.small_ok, "large_ok": e.large_ok}
            f.write(json.dumps(row | {"label": e.small_ok, "messages": list(e.messages)}) + "\n")
    return path
