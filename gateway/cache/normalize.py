"""Request normalization for the response cache: two requests that must get the same answer get the
same key, and two that may get different answers never do.

What is folded (when the tenant's `CacheSettings` allow it):

- Unicode to NFC (an accent typed precomposed or combining is the same text);
- whitespace that cannot change the answer: line endings, trailing spaces, runs of spaces inside a
  line, runs of blank lines, indentation common to every line. Leading indentation is otherwise kept
  (Python's meaning depends on it) and fenced code blocks are left alone except for line ends;
- volatile spans in system prompts (timestamps, dates, UUIDs, request ids, long hex, long base64),
  replaced by placeholders: templated system prompts that stamp "now" or a request id would otherwise
  never hit. User and assistant text is never masked: "what weekday is 2026-11-24?" or "decode this
  base64" depends on exactly that span;
- parameters: JSON key order, None values, 0 vs 0.0, the order and duplicates of `stop`, fields
  that do not change the answer (`stream`, `user`, ...).

Ordinary numbers and words are never touched: "12 times 7" and "12 times 8" are different keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.policy import CacheSettings

ALL_MASKS: tuple[str, ...] = ("timestamps", "dates", "uuids", "request_ids", "hex", "base64")

# Fields that change how the answer is delivered or billed, not what it says.
_NOT_ANSWER_CHANGING = frozenset({"stream", "stream_options", "user", "model", "cache", "metadata", "store"})
# Values equal to the API's defaults are dropped so that sending the default and omitting it agree.
_DEFAULTS: dict[str, Any] = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0}


@dataclass(frozen=True)
class CacheKey:
    key: str  # sha256 hex of `canonical`
    canonical: str  # canonical JSON of {"endpoint", "tier", "input", "params"} after normalization
    text: str  # the normalized conversation as plain text, one "role: content" line per message — for embeddings
    params: str  # canonical JSON of what besides the text decides the answer (a semantic hit must match it exactly)


# --- masks ---------------------------------------------------------------------------------------------

_MON = r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"  # noqa: E501
_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*"
_ISO_DATE = r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
_ZONE = r"(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2})(?![A-Za-z]))?"
_CLOCK = r"\d{1,2}:\d{2}:\d{2}(?:[.,]\d+)?"

_TIMESTAMP = re.compile(
    "|".join(
        (
            # ISO 8601 and its log variants: 2026-11-24T10:28:06.123Z, 2026-11-24 10:28:06 +0100
            rf"(?<![\d-]){_ISO_DATE}[T ]\d{{2}}:\d{{2}}(?::\d{{2}}(?:[.,]\d+)?)?{_ZONE}(?!\d)",
            # date(1): Tue Nov 24 10:28:06 UTC 2026
            rf"\b{_DAY}\s+{_MON}\s+\d{{1,2}}\s+{_CLOCK}(?:\s+[A-Z]{{2,5}})?\s+\d{{4}}\b",
            # RFC 2822: Tue, 24 Nov 2026 10:28:06 +0000
            rf"\b(?:{_DAY},?\s+)?\d{{1,2}}\s+{_MON}\s+\d{{4}}\s+{_CLOCK}{_ZONE}",
            # Apache common log: 24/Nov/2026:10:28:06 +0000
            rf"\b\d{{1,2}}/{_MON}/\d{{4}}:{_CLOCK}{_ZONE}",
            # a bare clock time with seconds: 10:28:06, 10:28:06.5 PM UTC (HH:MM alone is too ambiguous)
            rf"(?<![\d:]){_CLOCK}(?:\s?[AaPp][Mm])?{_ZONE}(?![\d:])",
        )
    )
)
_DATE = re.compile(
    "|".join(
        (
            rf"(?<![\d-]){_ISO_DATE}(?![\d])",
            r"(?<![\d/.])\d{1,2}[/.]\d{1,2}[/.]\d{4}(?![\d]|[/.]\d)",  # 24/11/2026, 11/24/2026, 24.11.2026
            rf"\b(?:{_DAY},?\s+)?{_MON}\.?\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}\b",  # Tuesday, Nov 24, 2026
            rf"\b(?:{_DAY},?\s+)?\d{{1,2}}(?:st|nd|rd|th)?\s+{_MON}\.?,?\s+\d{{4}}\b",  # 24 November 2026
        )
    )
)
_UUID = re.compile(r"(?<![0-9A-Fa-f-])[0-9A-Fa-f]{8}-(?:[0-9A-Fa-f]{4}-){3}[0-9A-Fa-f]{12}(?![0-9A-Fa-f-])")
# A labelled id (request-id: ..., x-trace-id=...) or a prefixed one (req_abc123XYZ, trace-9f8e7d6c). Both
# need a digit in the value, so words such as "request-response" or "trace id format" stay.
_ID_LABEL = re.compile(
    r"(?<![A-Za-z0-9])((?:x-)?(?:request|req|trace|span|correlation|corr)[-_ ]?id\s*[:=]\s*)"
    r"([\"']?)(?=[A-Za-z0-9._:-]*\d)[A-Za-z0-9][A-Za-z0-9._:-]{3,}\2",
    re.IGNORECASE,
)
_ID_PREFIXED = re.compile(
    r"(?<![A-Za-z0-9])(?:req|request|rid|trace|span|corr|correlation)[-_](?=[A-Za-z0-9]*\d)[A-Za-z0-9]{6,}"
    r"(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_B64_CHARS = r"A-Za-z0-9+/_\-"
# Random base64 of 24+ characters all but always mixes upper case, lower case and digits; requiring all
# three keeps paths (lower case) and numbers out. Pure hex (0xDEADBEEF...) is left to the hex mask.
_BASE64 = re.compile(
    rf"(?<![{_B64_CHARS}=])(?!(?:0[xX])?[0-9A-Fa-f]+(?![{_B64_CHARS}=]))(?=[{_B64_CHARS}]*[A-Z])(?=[{_B64_CHARS}]*[a-z])(?=[{_B64_CHARS}]*\d)"
    rf"[{_B64_CHARS}]{{24,}}={{0,2}}(?![{_B64_CHARS}=])"
)
# 16+ hex digits with at least one digit and one letter: not an ordinary (decimal) number, not a word.
_HEX = re.compile(
    r"(?<![A-Za-z0-9])(?:0[xX])?(?=[0-9A-Fa-f]*\d)(?=[0-9A-Fa-f]*[A-Fa-f])[0-9A-Fa-f]{16,}(?![A-Za-z0-9])"
)


def _mask_ids(text: str) -> str:
    text = _ID_LABEL.sub(lambda m: f"{m.group(1)}«id»", text)
    return _ID_PREFIXED.sub("«id»", text)


# Applied in this order whatever order the settings list: UUIDs before hex, timestamps before dates (a
# timestamp contains a date), ids before base64 (req_... would otherwise read as base64).
_MASKS: tuple[tuple[str, Any], ...] = (
    ("uuids", lambda t: _UUID.sub("«uuid»", t)),
    ("timestamps", lambda t: _TIMESTAMP.sub("«ts»", t)),
    ("dates", lambda t: _DATE.sub("«date»", t)),
    ("request_ids", _mask_ids),
    ("base64", lambda t: _BASE64.sub("«b64»", t)),
    ("hex", lambda t: _HEX.sub("«hex»", t)),
)


def _apply_masks(text: str, masks: Sequence[str]) -> str:
    wanted = set(masks)
    unknown = wanted - set(ALL_MASKS)
    if unknown:
        raise ValueError(f"unknown masks: {', '.join(sorted(unknown))}")
    for name, apply in _MASKS:
        if name in wanted:
            text = apply(text)
    return text


# --- whitespace ----------------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
# Quoted spans keep their spacing: in a string literal ("a  b") the spaces are content.
_SPACE = r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000]"
_QUOTED_OR_SPACE = re.compile(
    r"\"[^\"\n]*\"|`[^`\n]*`|(?<![A-Za-z0-9])'[^'\n]*'(?![A-Za-z0-9])"  # quoted: kept
    rf"|{_SPACE}{{2,}}|(?! ){_SPACE}"  # a run of spaces, or a single tab / unusual space: one space
)
_INVISIBLE = re.compile(r"[\u200b\ufeff]")  # zero-width space, BOM: never meant as content


def _fold_whitespace(text: str) -> str:
    text = _INVISIBLE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    out: list[str] = []
    fence: str | None = None
    for line in text.split("\n"):
        line = line.rstrip()
        marker = _FENCE.match(line)
        if fence is not None:  # inside a code block only line ends go: alignment can be meaningful
            if marker and marker.group(1) == fence:
                fence = None
            out.append(line)
            continue
        if marker:
            fence = marker.group(1)
            out.append(line)
            continue
        indent = line[: len(line) - len(line.lstrip())]
        out.append(indent + _fold_inner(line[len(indent) :]))
    # Runs of blank lines (2+ in a row) read as one paragraph break, outside code blocks and in.
    folded = re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip("\n")
    return _dedent(folded)


def _fold_inner(line: str) -> str:
    """Collapse the space runs of a line without its indentation and line end (so every run is interior)."""
    return _QUOTED_OR_SPACE.sub(lambda m: " " if m.group().isspace() else m.group(), line)


def _dedent(text: str) -> str:
    """Remove the indentation every non-blank line shares: relative indentation, all that code depends on, stays."""
    lines = text.split("\n")
    indents = [line[: len(line) - len(line.lstrip())] for line in lines if line.strip()]
    if not indents:
        return ""
    common = indents[0]
    for ind in indents[1:]:
        while not ind.startswith(common):
            common = common[:-1]
    return "\n".join(line[len(common) :] for line in lines) if common else text


def normalize_text(text: str, *, fold_whitespace: bool = True, masks: Sequence[str] = ALL_MASKS) -> str:
    text = unicodedata.normalize("NFC", text)
    if masks:
        text = _apply_masks(text, masks)
    if fold_whitespace:
        text = _fold_whitespace(text)
    return text


# --- requests ------------------------------------------------------------------------------------------


def _canonical_number(value: Any) -> Any:
    # JSON writes 0.0 and 0 differently; the sampler does not tell them apart.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _canonical_value(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return _canonical_number(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical_value(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_canonical_value(v) for v in value]
    if hasattr(value, "model_dump"):
        return _canonical_value(value.model_dump())
    return str(value)


def _canonical_params(params: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in params.items():
        if value is None or name in _NOT_ANSWER_CHANGING:
            continue
        if name == "stop":
            # Generation stops at whichever stop string comes first: their order and repeats don't matter.
            stops = [value] if isinstance(value, str) else list(value)
            if not stops:
                continue
            out[name] = sorted(set(stops))
            continue
        value = _canonical_value(value)
        if name in _DEFAULTS and value == _DEFAULTS[name]:
            continue
        out[name] = value
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, Mapping) else getattr(message, name, None)


def _content_text(content: Any) -> str:
    """A message's text, as gateway.http.schemas.ChatMessage.text(): text parts joined with nothing between."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        else:
            parts.append(_field(part, "text") or "")
    return "".join(parts)


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(x, int) for x in prompt)


def request_key(
    endpoint: str,
    tier: str,
    conversation: list[dict[str, Any]] | str | list[str] | list[int] | list[list[int]],
    params: Mapping[str, Any],
    settings: CacheSettings,
) -> CacheKey:
    fold = settings.fold_whitespace
    text: str
    inp: Any
    if isinstance(conversation, str):
        # A raw prompt is the client's own text: folded, never masked (see the module docstring).
        inp = normalize_text(conversation, fold_whitespace=fold, masks=())
        text = inp
    elif _is_token_ids(conversation):
        inp = list(conversation)  # token ids are kept as they are
        text = " ".join(map(str, inp))
    elif conversation and all(isinstance(p, str) for p in conversation):
        inp = [normalize_text(p, fold_whitespace=fold, masks=()) for p in conversation]  # type: ignore[arg-type]
        text = "\n".join(inp)
    elif conversation and all(_is_token_ids(p) for p in conversation):
        inp = [list(p) for p in conversation]  # type: ignore[arg-type]
        text = "\n".join(" ".join(map(str, p)) for p in inp)
    else:
        inp, lines = [], []
        for message in conversation:
            role = _field(message, "role")
            role = "system" if role == "developer" else str(role)
            masks = settings.masks if role == "system" else ()
            content = normalize_text(_content_text(_field(message, "content")), fold_whitespace=fold, masks=masks)
            entry: dict[str, Any] = {"role": role, "content": content}
            if name := _field(message, "name"):  # chat templates may show the speaker's name
                entry["name"] = str(name)
            line = f"{role}: {content}"
            if calls := _field(message, "tool_calls"):  # an assistant turn's calls, arguments included
                entry["tool_calls"] = _canonical_value(calls)
                line += " " + _dumps(entry["tool_calls"])
            if call_id := _field(message, "tool_call_id"):  # which call a tool's result answers
                entry["tool_call_id"] = str(call_id)
            inp.append(entry)
            lines.append(line)
        text = "\n".join(lines)
    canon_params = _canonical_params(params)
    canonical = _dumps({"endpoint": endpoint, "tier": tier, "input": inp, "params": canon_params})
    # The endpoint and tier decide the answer as much as the sampling parameters do, so a semantic hit,
    # which compares only `text` and `params`, must match them too.
    params_json = _dumps({"endpoint": endpoint, "tier": tier, "params": canon_params})
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), canonical, text, params_json)


def is_deterministic(temperature: float | None, seed: int | None) -> bool:
    """Greedy decoding or a fixed seed: the same request gets the same answer, so a stored one is valid."""
    return temperature == 0 or seed is not None
