"""The semantic cache's lexical guards: what embeddings blur and a shared answer cannot survive.

`guard(a, b)` says why two questions that look alike must not share an answer: they differ in numbers
(digits or number words), negation, named entities, quoted strings, a content word swapped for one that
is not its synonym, the direction of a conversion, or a pair of opposites. `differing_sentences(a, b)`
cuts away the sentences two texts share (a template's frame: an instruction, a label such as "Review:"),
so that the similarity the cache tests is that of what was filled in, not of the whole text, where a long
shared frame makes different slots look alike ("Write one sentence about the city at night." / "... about
a lighthouse." with the same long instruction after each: 0.807 similar as wholes, 0.61 as sentences).
`differing_words(a, b)` does the same by words, for long texts without sentences to cut at.
"""

from __future__ import annotations

import difflib
import re

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# Number words count as their digits ("twelve times seven" is "12 times 7"). "one" is left out: it is
# mostly a pronoun or an article ("which one", "one line at a time"), and any other count is explicit.
_SMALL = ("zero", "", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
          "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty")  # fmt: skip
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(_SMALL) if w} | {
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80", "ninety": "90",
    "hundred": "100", "thousand": "1000", "million": "1000000", "billion": "1000000000", "dozen": "12",
    "half": "0.5", "twice": "2", "thrice": "3",
}  # fmt: skip
_NUMBER_WORD = re.compile(r"\b(?:" + "|".join(_NUMBER_WORDS) + r")\b", re.I)
_NEGATION = re.compile(r"\b(?:not|no|never|none|nothing|nobody|neither|nor|without|cannot)\b|n't\b", re.I)
_QUOTED = re.compile(r"\"([^\"]+)\"|“([^”]+)”|`([^`]+)`|(?<!\w)'([^']+)'(?!\w)")
_WORD = re.compile(r"[A-Za-z][\w-]*")
_OPPOSITES = (("ascending", "descending"), ("increase", "decrease"), ("faster", "slower"), ("before", "after"),
              ("max", "min"), ("maximum", "minimum"), ("largest", "smallest"), ("add", "remove"),
              ("install", "uninstall"), ("encode", "decode"), ("encrypt", "decrypt"))  # fmt: skip


# Instruction verbs that ask the same thing; any other single-word swap changes the question.
_SYNONYMS = [{"write", "compose", "create", "make", "draft"}, {"describe", "explain", "summarize", "outline"},
             {"list", "name", "give", "show"}, {"tell", "give"}, {"how", "what"}]  # fmt: skip
_STOP = {
    "a",
    "an",
    "the",
    "to",
    "of",
    "in",
    "on",
    "for",
    "me",
    "my",
    "i",
    "you",
    "your",
    "is",
    "are",
    "do",
    "does",
    "can",
    "could",
    "would",
    "please",
    "kindly",
    "what",
    "how",
    "s",
    "d",
    "way",
    "best",
    "it",
    "this",
    "that",
    "with",
    "and",
    "have",
    "like",
    "know",
    "want",
    "need",
    "answer",
    "question",
    "help",
    "following",
    "thank",
    "thanks",
    "advance",
    "hi",
    "hello",
}  # fmt: skip (politeness and framing: no change of question)


# Prepositions that rephrasing trades freely ("duplicates from a list" / "in a list"); from/to is checked apart.
_LIGHT = {"from", "into", "at", "by", "about", "using", "within", "inside", "via"}
_PREPOSITIONS = _LIGHT | {"in", "on", "of", "for", "with", "to"}


def _entities(text: str) -> set[str]:
    """Capitalized words not opening a sentence, acronyms, and names with digits (GPT-4)."""
    found = set()
    for line in text.splitlines():
        for sentence in re.split(r"(?<=[.!?:])\s+", line.split(": ", 1)[-1]):
            for i, m in enumerate(_WORD.finditer(sentence)):
                w = m.group()
                capitalized = i > 0 and w[0].isupper() and len(w) > 1
                if capitalized or (len(w) > 1 and w.isupper()) or any(c.isdigit() for c in w):
                    found.add(w.lower())
    return found


_ANY_NUMBER = re.compile(f"{_NUMBER.pattern}|{_NUMBER_WORD.pattern}", re.I)


def _numbers(text: str) -> list[str]:
    """The numbers in the order they come, digits and number words alike, thousands separators dropped
    ("1,000"): "5 minus 2" is not "2 minus 5", nor `f(1, 2)` `f(2, 1)`."""
    found = []
    for n in _ANY_NUMBER.findall(text):
        if n.lower() in _NUMBER_WORDS:
            found.append(_NUMBER_WORDS[n.lower()])
        else:
            found.append(n.replace(",", "") if re.fullmatch(r"\d{1,3}(?:,\d{3})+", n) else n)
    return found


def _words(text: str) -> list[str]:
    words = re.findall(r"[a-z0-9]+", re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower()))  # 1,000 is 1000
    return [w[:-1] if len(w) > 3 and w.endswith("s") and w not in _STOP else w for w in words]  # crude plurals


def _synonyms(x: set[str], y: set[str]) -> bool:
    return any(x <= group and y <= group for group in _SYNONYMS)


def _one_for_one(x: list[str], y: list[str]) -> bool:
    """One content word for another that is not its synonym (numbers are `_numbers`' business: "twelve"/"12")."""
    if len(x) != 1 or len(y) != 1 or {x[0], y[0]} & (_STOP | _LIGHT):
        return False
    if any(w.isdigit() or w in _NUMBER_WORDS for w in (x[0], y[0])):
        return False
    return not _synonyms({x[0]}, {y[0]})


def _swapped(a: str, b: str) -> bool:
    """The same words in another order ("miles to kilometers" / "kilometers to miles"), a direction turned
    around ("from English" / "to English"), one content word swapped for another that is not a synonym
    ("primary colors" / "secondary colors", "remove duplicates from" / "find duplicates in": edits among
    light words such as prepositions don't count as a second change), or several, each one word for one
    and nothing else changed ("minutes in 8 hours" / "seconds in 8 minutes"), or content words added and
    nothing else changed ("are you X" / "are you based on X")."""
    wa, wb = _words(a), _words(b)
    if wa != wb and sorted(wa) == sorted(wb):
        return True
    ops = [op for op in difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes() if op[0] != "equal"]
    for _, i1, i2, j1, j2 in ops:
        x, y = set(wa[i1:i2]), set(wb[j1:j2])
        short = i2 - i1 <= 2 and j2 - j1 <= 2  # a longer edit is a rewording, not a turned direction
        if short and (("from" in x and y & {"to", "into"}) or ("from" in y and x & {"to", "into"})):
            return True
    if len(ops) != 1:
        ops = [op for op in ops if set(wa[op[1] : op[2]] + wb[op[3] : op[4]]) - _PREPOSITIONS]
        swaps = [op for op in ops if set(wa[op[1] : op[2]] + wb[op[3] : op[4]]) - _STOP - _LIGHT]
        if len(swaps) > 1 and all(_one_for_one(wa[i1:i2], wb[j1:j2]) for _, i1, i2, j1, j2 in swaps):
            return True
        if len(ops) != 1:
            return False
    kind, i1, i2, j1, j2 = ops[0]
    if kind != "replace":  # words only added or only dropped: "are you X" / "are you based on X"
        return bool(set(wa[i1:i2] + wb[j1:j2]) - _STOP)
    x, y = set(wa[i1:i2]) - _STOP - _LIGHT, set(wb[j1:j2]) - _STOP - _LIGHT
    if not x or not y or i2 - i1 > 2 or j2 - j1 > 2:
        return False
    return not _synonyms(x, y)


def guard(a: str, b: str) -> str | None:
    """None if the two normalized texts may share an answer, else why not."""
    if _numbers(a) != _numbers(b):
        return "numbers"
    if len(_NEGATION.findall(a)) != len(_NEGATION.findall(b)):
        return "negation"
    if {"".join(g) for g in _QUOTED.findall(a)} != {"".join(g) for g in _QUOTED.findall(b)}:
        return "quoted"
    if _entities(a) != _entities(b):
        return "entities"
    if _swapped(a, b):
        return "swapped"
    wa, wb = set(re.findall(r"\w+", a.lower())), set(re.findall(r"\w+", b.lower()))
    only_a, only_b = wa - wb, wb - wa  # a word both texts have is no swap: a long document has "before" and "after"
    for x, y in _OPPOSITES:
        if (x in only_a and y in only_b) or (y in only_a and x in only_b):
            return "opposites"
    return None


_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def _sentences(text: str) -> list[str]:
    """Sentences and clauses ended by `.!?;:`, and lines: the units a template's frame is made of."""
    return [s for line in text.splitlines() for s in _SENTENCE_END.split(line.strip()) if s]


def differing_sentences(a: str, b: str) -> tuple[str, str] | None:
    """The sentences between the two texts' shared leading and trailing ones (the same words, case and
    punctuation aside), when they share any and differ in words at all; else None (no frame: the whole
    texts are what differ). A side may be empty: a sentence only added."""
    if _words(a) == _words(b):
        return None
    sa, sb = _sentences(a), _sentences(b)
    n = min(len(sa), len(sb))
    head = 0
    while head < n and _words(sa[head]) == _words(sb[head]):
        head += 1
    tail = 0
    while tail < n - head and _words(sa[-1 - tail]) == _words(sb[-1 - tail]):
        tail += 1
    if head == tail == 0:
        return None
    return " ".join(sa[head : len(sa) - tail]), " ".join(sb[head : len(sb) - tail])


def differing_words(a: str, b: str) -> tuple[str, str] | None:
    """The words between the two texts' shared leading and trailing words (split at whitespace, case aside),
    when they differ at all; else None. For what has no sentences to cut at (a word list, a long
    comma-separated list, a log line, a table row): the part of a long text its embedding may not even see."""
    wa, wb = a.split(), b.split()
    la, lb = [w.lower() for w in wa], [w.lower() for w in wb]
    if la == lb:
        return None
    n = min(len(la), len(lb))
    head = 0
    while head < n and la[head] == lb[head]:
        head += 1
    tail = 0
    while tail < n - head and la[-1 - tail] == lb[-1 - tail]:
        tail += 1
    return " ".join(wa[head : len(wa) - tail]), " ".join(wb[head : len(wb) - tail])


def only_framing_differs(x: str, y: str) -> bool:
    """The words one text has and the other lacks are all politeness and framing ("Please, hi!" / "Hi!",
    "Thanks!" / ""), and the others come in the same order ("f(1, 2)" / "f(2, 1)" is no politeness): no
    question changed."""
    kept = lambda t: [w for w in _words(t) if w not in _STOP]  # noqa: E731
    return kept(x) == kept(y)
