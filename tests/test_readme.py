"""The README stays short and true: at most 300 lines, its lists of accepted and refused request fields
equal what `gateway.http.schemas` accepts and refuses, no page in docs/ calls an accepted field refused, and
every relative link in README.md and docs/*.md points to a file (and heading) that exists.

Each check is a function over text, shown here to catch a planted mistake.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.http.schemas import UNSUPPORTED_CHAT, UNSUPPORTED_COMPLETION, ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

REFUSED_LABEL = "Refused request fields:"
ACCEPTED_LABEL = "Accepted request fields:"
# A sentence that says request fields are refused: it talks of a field and of refusing or not serving it.
REFUSAL = re.compile(r"\b(refused|unsupported|not supported|not serve[ds]?|do not serve|don't serve)\b", re.I)
FIELD = re.compile(r"\bfields?\b", re.I)
CODE_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def refused_by_schema() -> set[str]:
    return set(UNSUPPORTED_CHAT) | set(UNSUPPORTED_COMPLETION)


def accepted_by_schema() -> set[str]:
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    return fields - refused_by_schema()


def prose(text: str) -> str:
    """Markdown without its fenced code blocks."""
    return CODE_FENCE.sub("", text)


def labeled_lists(text: str, label: str) -> list[set[str]]:
    """The backticked names on every line that starts with `label`."""
    return [set(re.findall(r"`([^`]+)`", line)) for line in prose(text).splitlines() if line.startswith(label)]


def refusal_claims(text: str) -> list[str]:
    """Every place that names a field the schema accepts as refused: on a "Refused request fields:" line,
    or in a sentence about refused (unsupported, not served) fields."""
    accepted = accepted_by_schema()
    problems = []
    for names in labeled_lists(text, REFUSED_LABEL):
        problems += [f"{REFUSED_LABEL} lists `{n}`, which the schema accepts" for n in sorted(names & accepted)]
    unlabeled = "\n".join(line for line in prose(text).splitlines() if not line.startswith(REFUSED_LABEL))
    # sentences, paragraphs and table rows
    for sentence in re.split(r"(?<=[.!?])\s+|\n\s*\n|\n(?=\|)", unlabeled):
        if REFUSAL.search(sentence) and FIELD.search(sentence):
            named = set(re.findall(r"`([^`]+)`", sentence)) & accepted
            flat = " ".join(sentence.split())
            problems += [f"`{n}` is accepted by the schema, but called refused in: {flat[:160]}" for n in sorted(named)]
    return problems


def github_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercase, punctuation dropped, spaces to hyphens,
    repeats numbered -1, -2..."""
    slugs: set[str] = set()
    for line in prose(markdown).splitlines():
        if not (m := re.match(r"#{1,6}\s+(.*)", line)):
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in slugs:
            n += 1
            slug = f"{base}-{n}"
        slugs.add(slug)
    return slugs


def broken_links(text: str, page: Path) -> list[str]:
    """Relative links in `text` (the page at `page`) whose file, or heading, does not exist."""
    problems = []
    for target in LINK.findall(prose(text)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md":
            source = text if dest == page else dest.read_text()
            if anchor not in github_slugs(source):
                problems.append(f"{page.name}: {target} (no such heading in {dest.name})")
    return problems


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; depth belongs in docs/"


def test_readme_lists_exactly_the_refused_fields() -> None:
    lists = labeled_lists(README.read_text(), REFUSED_LABEL)
    assert len(lists) == 1, f"README.md needs one line starting {REFUSED_LABEL!r}"
    assert lists[0] == refused_by_schema(), (
        f"README lists {sorted(lists[0])}; gateway.http.schemas refuses {sorted(refused_by_schema())}"
    )


def test_readme_lists_exactly_the_accepted_fields() -> None:
    lists = labeled_lists(README.read_text(), ACCEPTED_LABEL)
    assert len(lists) == 1, f"README.md needs one line starting {ACCEPTED_LABEL!r}"
    assert lists[0] == accepted_by_schema(), (
        f"README lists {sorted(lists[0])}; gateway.http.schemas accepts {sorted(accepted_by_schema())}"
    )


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_calls_an_accepted_field_refused(page: Path) -> None:
    text = page.read_text()
    assert refusal_claims(text) == []
    for names in labeled_lists(text, REFUSED_LABEL):
        assert names == refused_by_schema(), f"{page.name}: its {REFUSED_LABEL!r} line is not the schema's list"


def test_the_refusal_check_catches_a_planted_claim() -> None:
    readme = README.read_text()
    assert "response_format" in accepted_by_schema(), "the plant needs a field the schema accepts"
    assert refusal_claims(readme) == []
    listed = readme + f"\n{REFUSED_LABEL} `audio`, `response_format`.\n"
    assert refusal_claims(listed) == [f"{REFUSED_LABEL} lists `response_format`, which the schema accepts"]
    in_prose = readme + "\nFields we know but do not serve yet (`audio`, `response_format`) get a 400.\n"
    [problem] = refusal_claims(in_prose)
    assert problem.startswith("`response_format` is accepted by the schema")
    # ...and the exact-list test would fail too: the planted list is not the schema's.
    assert labeled_lists(listed, REFUSED_LABEL)[-1] != refused_by_schema()


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page.read_text(), page) == []


def test_the_link_check_catches_planted_links() -> None:
    text = README.read_text() + "\n[gone](docs/no-such-page.md) [lost](docs/api.md#no-such-heading) [ok](docs/api.md)\n"
    assert broken_links(text, README) == [
        "README.md: docs/no-such-page.md (no such file)",
        "README.md: docs/api.md#no-such-heading (no such heading in api.md)",
    ]


def test_github_slugs() -> None:
    page = "# Caches\n## KV prefix tier (`engines/kv/tier.py`)\n## Measured\n### Measured\n```\n# not a heading\n```\n"
    assert github_slugs(page) == {"caches", "kv-prefix-tier-engineskvtierpy", "measured", "measured-1"}
