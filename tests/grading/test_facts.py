"""Short facts: the label set is built from registry packages' data and shares no question and no subject
with the bench's held-out set; the parsers read each package's own format."""

from __future__ import annotations

import re
import textwrap

from bench.savings_trace import fact_items
from grading.datasets import ANSWER_TOKENS, items_by_id, load_items
from grading.facts import (
    HELD_OUT,
    _held_out_subjects,
    elements,
    grade_fact,
    label_facts,
    state_capitals,
    unit_factors,
)
from grading.graders import GRADERS
from tests.conftest import MODELS_HOME


def test_the_bench_asks_the_held_out_facts_unchanged() -> None:
    items = fact_items()
    assert len(items) == len(HELD_OUT) == 135
    assert items[0].question == "What is the capital of France? Answer in a few words."
    assert items[0].grading == {"answer": "Paris"} and items[-1].grading == {"answer": "32"}


def test_label_facts_share_no_question_or_subject_with_the_held_out_ones() -> None:
    facts = label_facts(MODELS_HOME)
    questions = [q for q, _ in facts]
    assert len(facts) == len(set(questions)) == 430
    assert not set(questions) & {q for q, _ in HELD_OUT}
    subjects = _held_out_subjects()
    assert {"france", "paris", "netherlands", "gold", "carbon"} <= subjects
    for question, answer in facts:  # the thing asked about and the answer, whichever template asked
        subject = re.sub(
            r"^What is the (capital of( the US state of)?|chemical symbol for|atomic number of) ", "", question
        )
        assert subject.rstrip("?").lower() not in subjects and answer.lower() not in subjects, question
    found = dict(facts)
    assert found["What is the capital of the US state of Texas?"] == "Austin"
    assert found["What is the capital of Uganda?"] == "Kampala"
    assert found["What is the atomic number of xenon?"] == "54" and "What is the atomic number of cesium?" not in found
    assert found["How many inches are in 2 feet?"] == "24"  # implied: foot = yard / 3, inch = yard / 36
    assert found["How many pints are in 3 gallons?"] == "24"  # a chain: gallon → quart → pint
    assert not any("minute" in q or "meters are" in q for q in questions)  # held-out units only


def test_label_facts_load_as_a_graded_source() -> None:
    items = load_items(MODELS_HOME, ["fact"])
    assert len(items) == 430 and all(i.source == "fact" and i.id.startswith("fact/") for i in items)
    assert not {i.id for i in items} & {i.id for i in fact_items()}  # the bench's ids are fact/<n>
    texas = items_by_id(MODELS_HOME, ["fact/what-is-the-capital-of-the-us-state-of-texas"])
    item = next(iter(texas.values()))
    assert item.question == "What is the capital of the US state of Texas? Answer in a few words."
    assert GRADERS["fact"](item, "Austin, Texas.") and not GRADERS["fact"](item, "Houston")
    assert ANSWER_TOKENS["fact"] == 32


def test_containment_grading() -> None:
    assert grade_fact({"answer": "Paris"}, "The capital of France is paris.")
    assert not grade_fact({"answer": "Paris"}, "It is Parisian cuisine you mean?")
    assert grade_fact({"answer": "1000"}, "There are 1,000 grams in a kilogram.")
    assert not grade_fact({"answer": "100"}, "There are 1000 of them.")
    assert grade_fact({"answer": "Au"}, "Its symbol is Au.") and not grade_fact({"answer": "Au"}, "au revoir")


def test_package_parsers_on_their_formats() -> None:
    states = textwrap.dedent("""
        class State: ...
        AL = State(**{"name": "Alabama", "capital": "Montgomery", "is_territory": False, "is_obsolete": False,
                      "is_associated": False, "counties": []})
        GU = State(**{"name": "Guam", "capital": "Hagåtña", "is_territory": True, "is_obsolete": False,
                      "is_associated": False})
        PW = State(**{"name": "Palau", "capital": "Ngerulmud", "is_territory": False, "is_obsolete": False,
                      "is_associated": True})
        DK = State(**{"name": "Dakota", "capital": "Yankton", "is_territory": False, "is_obsolete": True,
                      "is_associated": False})
    """)
    assert state_capitals(states) == [("Alabama", "Montgomery")]
    table = "element_base: dict[int, tuple] = {0: ('neutron', 'n', [], []), 1: ('Hydrogen', 'H', [-1, 1], [])}\n"
    assert elements(table) == [(1, "hydrogen", "H")]
    units = textwrap.dedent("""
        yard = 0.9144 * meter = yd
        inch = yard / 36 = in
        foot = yard / 3 = ft
        mile = 1760 * yard = mi
        grain = 64.79891 * milligram = gr
        millennium = 1e3 * year = _ = millennia
        _bad = 2 * foot
    """)
    found = unit_factors(units)
    assert found[:3] == [("yard", "inch", 36), ("yard", "foot", 3), ("mile", "yard", 1760)]
    assert ("millennium", "year", 1000) in found and ("foot", "inch", 12) in found
    assert ("mile", "foot", 5280) in found and not any("grain" in f or "_bad" in f for f in found)
