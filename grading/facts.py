"""Short factual questions with reference answers: the bench's held-out set and the router's label set.

The two never share a subject, so a router labeled on one is measured on the other:

- `HELD_OUT` (`held_out_facts`): what `bench.savings` asks, written here by hand: 40 country capitals, 15
  chemical symbols, 8 unit conversions × n = 2..10, 8 other facts (135).
- `label_facts(home)`: built from data that registry packages ship, minus every subject `HELD_OUT` asks
  about: the capitals of the other countries (`countryinfo`), the 50 US state capitals (`us`), the
  symbols and atomic numbers of the other elements through xenon (`periodictable`), and whole-number
  conversions between the everyday US customary and calendar units that `pint` defines (inch, yard,
  pound, gallon, fortnight…) for n in `CONVERSION_NS`: 430 questions.

Both grade by containment (`grade_fact`): a number answer is right when any number in the text equals
it; a word answer when it appears as whole words, ignoring case (a symbol of two letters or fewer must
match its case, "Au" is not "au revoir").
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from engines.checkpoints.fetch import fetch_package_file, fetch_package_tree
from grading.answers import canonical_number
from grading.items import Item, user

__all__ = ["FACT_INSTRUCTION", "HELD_OUT", "grade_fact", "held_out_facts", "label_facts", "load_fact_items"]

FACT_INSTRUCTION = "Answer in a few words."
COUNTRIES = ("countryinfo", "1.0.1", "countryinfo/data")
US_STATES = ("us", "4.0.0", "us/states.py")
ELEMENTS = ("periodictable", "2.1.0", "periodictable/core.py")
UNITS = ("pint", "0.25.3", "pint/default_en.txt")
CONVERSION_NS = (2, 3, 5, 8)  # how many of the larger unit a conversion question asks about
LAST_ELEMENT = 54  # xenon: the elements through period 5 (the rarer ones past it every tier gets wrong)
# Everyday units: pint defines ~90 whole-number pairs, most of them (hartree, scruple, didot) facts no tier
# knows, which would teach the router only that a conversion is hard.
EVERYDAY_UNITS = {"inch", "foot", "yard", "mile", "cup", "pint", "quart", "gallon", "fluid_ounce", "tablespoon",
                  "teaspoon", "ounce", "pound", "stone", "ton", "fortnight", "week", "century", "millennium",
                  "year", "byte", "bit", "metric_ton", "kilogram"}  # fmt: skip

_CAPITALS = (
    "France:Paris|Germany:Berlin|Italy:Rome|Spain:Madrid|Portugal:Lisbon|Japan:Tokyo|Canada:Ottawa|"
    "Australia:Canberra|Egypt:Cairo|Kenya:Nairobi|Norway:Oslo|Sweden:Stockholm|Finland:Helsinki|"
    "Denmark:Copenhagen|Poland:Warsaw|Austria:Vienna|Greece:Athens|Ireland:Dublin|Peru:Lima|Chile:Santiago|"
    "Argentina:Buenos Aires|Mexico:Mexico City|Russia:Moscow|China:Beijing|India:New Delhi|Thailand:Bangkok|"
    "Vietnam:Hanoi|Indonesia:Jakarta|Turkey:Ankara|Iran:Tehran|Cuba:Havana|Hungary:Budapest|Belgium:Brussels|"
    "the Netherlands:Amsterdam|Switzerland:Bern|Scotland:Edinburgh|Morocco:Rabat|Nigeria:Abuja|"
    "the United Kingdom:London|South Korea:Seoul"
)
_SYMBOLS = (
    "gold Au|silver Ag|iron Fe|sodium Na|potassium K|lead Pb|copper Cu|tin Sn|mercury Hg|helium He|"
    "oxygen O|carbon C|nitrogen N|calcium Ca|zinc Zn"
)
_CONVERSIONS = (  # (question with {n}, factor)
    ("How many centimeters are in {n} meters?", 100),
    ("How many minutes are in {n} hours?", 60),
    ("How many grams are in {n} kilograms?", 1000),
    ("How many seconds are in {n} minutes?", 60),
    ("How many days are in {n} weeks?", 7),
    ("How many millimeters are in {n} centimeters?", 10),
    ("How many meters are in {n} kilometers?", 1000),
    ("How many months are in {n} years?", 12),
)
_OTHER = (
    ("How many legs does a spider have?", "8"),
    ("How many days are in a leap year?", "366"),
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("Which planet is closest to the Sun?", "Mercury"),
    ("What is the boiling point of water at sea level in degrees Celsius?", "100"),
    ("How many continents are there?", "7"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"),
    ("What is the freezing point of water in degrees Fahrenheit?", "32"),
)
# Units the held-out conversions use: a label conversion between two of them would ask a held-out question.
_HELD_OUT_UNITS = {"centimeter", "meter", "millimeter", "kilometer", "minute", "hour", "second", "gram",
                   "kilogram", "day", "week", "month", "year"}  # fmt: skip
_PLURALS = {"foot": "feet", "century": "centuries", "inch": "inches", "millennium": "millennia"}
# `a = N * b` or `a = b / N` in pint's definitions, N a whole number (1e3 allowed), b a plain unit name.
_TIMES = re.compile(r"^\s*(\w+) = (\d+(?:e\d+)?) \* ([a-z_]+)\s*(?:=|#|$)")
_PER = re.compile(r"^\s*(\w+) = ([a-z_]+) / (\d+)\s*(?:=|#|$)")


def held_out_facts() -> list[tuple[str, str]]:
    """The bench's 135 (question, answer) pairs, in a fixed order (`bench.savings_trace.fact_items`)."""
    facts: list[tuple[str, str]] = []
    for pair in _CAPITALS.split("|"):
        country, capital = pair.split(":")
        facts.append((f"What is the capital of {country}?", capital))
    for pair in _SYMBOLS.split("|"):
        element, symbol = pair.split(" ")
        facts.append((f"What is the chemical symbol for {element}?", symbol))
    for question, factor in _CONVERSIONS:
        facts += [(question.format(n=n), str(n * factor)) for n in range(2, 11)]
    return facts + list(_OTHER)


HELD_OUT = held_out_facts()


def grade_fact(grading: dict[str, str], text: str) -> bool:
    """Containment (see the module docstring); `grading["answer"]` is the reference."""
    expected = grading["answer"]
    if (number := canonical_number(expected)) is not None:
        found = re.findall(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?", text)
        return number in {canonical_number(f) for f in found}
    flags = 0 if len(expected) <= 2 else re.IGNORECASE
    return re.search(rf"(?<![A-Za-z]){re.escape(expected)}(?![A-Za-z])", text, flags) is not None


def _held_out_subjects() -> set[str]:
    subjects = {pair.split(":")[0].removeprefix("the ").lower() for pair in _CAPITALS.split("|")}
    subjects |= {pair.split(":")[1].lower() for pair in _CAPITALS.split("|")}  # the capital, whatever the name
    return subjects | {pair.split(" ")[0] for pair in _SYMBOLS.split("|")}


def country_capitals(folder: Path) -> list[tuple[str, str]]:
    """(country, capital) of every country file with a capital, names in plain ASCII, sorted by country."""
    pairs = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        name, capital = str(data.get("name") or ""), str(data.get("capital") or "")
        if name and capital and re.fullmatch(r"[A-Za-z .'-]+", name + capital):
            pairs.append((name, capital))
    return sorted(set(pairs))


def state_capitals(source: str) -> list[tuple[str, str]]:
    """(state, capital) of the 50 states in `us/states.py` (`X = State(**{...})`): no territory, obsolete
    state or freely associated one (Palau)."""
    pairs = []
    for node in ast.parse(source).body:
        call = node.value if isinstance(node, ast.Assign) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "State" and call.keywords:
            fields = call.keywords[0].value
            if isinstance(fields, ast.Dict):
                state = {ast.literal_eval(k): v for k, v in zip(fields.keys, fields.values, strict=True) if k}
                keys = ("name", "capital", "is_territory", "is_obsolete", "is_associated")
                plain = {k: ast.literal_eval(state[k]) for k in keys}
                if plain["capital"] and not (plain["is_territory"] or plain["is_obsolete"] or plain["is_associated"]):
                    pairs.append((plain["name"], plain["capital"]))
    return sorted(pairs)


def elements(source: str) -> list[tuple[int, str, str]]:
    """(atomic number, name, symbol) from periodictable's `element_base` table, the neutron left out."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "element_base":
            table = ast.literal_eval(node.value)
            return [(z, name.lower(), symbol) for z, (name, symbol, *_) in sorted(table.items()) if z > 0]
    raise ValueError("no element_base table in periodictable/core.py")


def unit_factors(definitions: str) -> list[tuple[str, str, int]]:
    """(larger unit, smaller unit, how many smaller make one larger) for pint's whole-number definitions
    between two named units (`yard = 3 * foot`, `ounce = pound / 16`), in file order, then the pairs two
    definitions imply with a whole factor: through a shared larger unit (foot = yard / 3 and inch = yard / 36
    give 12 inches to the foot) and in a chain (gallon → quart → pint)."""
    found = _defined_factors(definitions)
    seen = {(big, small) for big, small, _ in found}
    implied = []
    for big, small, n in found:
        for big2, small2, m in found:
            if big2 == big and small2 != small and n % m == 0 and n > m:
                implied.append((small2, small, n // m))  # one small2 is n / m smalls
            if big2 == small:
                implied.append((big, small2, n * m))
    for pair in implied:
        if pair[:2] not in seen and pair[0] != pair[1]:
            seen.add(pair[:2])
            found.append(pair)
    return found


def _defined_factors(definitions: str) -> list[tuple[str, str, int]]:
    found = []
    for line in definitions.splitlines():
        if m := _TIMES.match(line):
            big, n, small = m.group(1), float(m.group(2)), m.group(3)
        elif m := _PER.match(line):
            small, big, n = m.group(1), m.group(2), float(m.group(3))
        else:
            continue
        if n > 1 and n == int(n) and not big.startswith("_") and not small.startswith("_"):
            found.append((big, small, int(n)))
    return found


def _plural(unit: str) -> str:
    words = unit.split("_")
    last = _PLURALS.get(words[-1], words[-1] + ("es" if words[-1].endswith(("s", "x", "ch")) else "s"))
    return " ".join([*words[:-1], last])


def label_facts(home: Path, *, progress: bool = False) -> list[tuple[str, str]]:
    """The label set (see the module docstring): (question, answer), no subject of `HELD_OUT` among them."""
    skip = _held_out_subjects()
    facts: list[tuple[str, str]] = []
    for country, capital in country_capitals(fetch_package_tree(*COUNTRIES, home, progress=progress)):
        if country.lower() not in skip and capital.lower() not in skip:
            facts.append((f"What is the capital of {country}?", capital))
    states = fetch_package_file(*US_STATES, home, progress=progress).read_text()
    facts += [(f"What is the capital of the US state of {s}?", c) for s, c in state_capitals(states)]
    for z, name, symbol in elements(fetch_package_file(*ELEMENTS, home, progress=progress).read_text()):
        if z <= LAST_ELEMENT and name not in skip:
            facts.append((f"What is the chemical symbol for {name}?", symbol))
            facts.append((f"What is the atomic number of {name}?", str(z)))
    units = fetch_package_file(*UNITS, home, progress=progress).read_text()
    for big, small, factor in unit_factors(units):
        if {big, small} <= EVERYDAY_UNITS and not {big, small} <= _HELD_OUT_UNITS:
            for n in CONVERSION_NS:
                facts.append((f"How many {_plural(small)} are in {n} {_plural(big)}?", str(n * factor)))
    held = {q for q, _ in HELD_OUT}
    return [(q, a) for q, a in dict.fromkeys(facts) if q not in held]


def _slug(question: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", question.lower()).strip("-")


def load_fact_items(home: Path, *, progress: bool = False) -> list[Item]:
    """The label set as items: id `fact/<question slug>` (never a bench id, which is `fact/<number>`)."""
    return [
        Item(f"fact/{_slug(q)}", "fact", user(f"{q} {FACT_INSTRUCTION}"), {"answer": a})
        for q, a in label_facts(home, progress=progress)
    ]
