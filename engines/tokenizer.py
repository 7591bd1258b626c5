"""Tokenizing, chat templates and end-of-turn ids for one model directory (via transformers)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers
from jinja2 import TemplateError

# What a model directory holds besides its config and weights, for tokenizing and generating.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """Copy `TOKENIZER_FILES` that `src` has into `dst` (a derived checkpoint tokenizes the same)."""
    import shutil

    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)


CHAT_CACHE_SIZE = 1024  # conversations whose token ids are remembered


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.backend: tokenizers.Tokenizer = self.hf.backend_tokenizer
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self.hf.eos_token_id))
        # Rendering the chat template (jinja) costs more than the rest of an exact cache hit's own work,
        # and hits are repeated conversations: remember recent ones. Thread-safe, bounded.
        self._chat_ids = functools.lru_cache(maxsize=CHAT_CACHE_SIZE)(self._encode_chat_key)
        # ...unless the template reads the clock (Llama 3's "Today Date"): then the same messages render anew
        self._remember_chats = "strftime_now" not in str(self.hf.chat_template or "")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if not self.hf.chat_template:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The rendered template already holds every special token the model expects.
        try:
            key = tuple(tuple(m.items()) for m in messages)
            hash(key)
        except TypeError:  # content parts or other unhashable values: not remembered
            key = None
        if key is None or not self._remember_chats:
            return self.encode(self.render_chat(messages), add_special_tokens=False)
        return list(self._chat_ids(key))

    def _encode_chat_key(self, key: tuple[tuple[tuple[str, Any], ...], ...]) -> tuple[int, ...]:
        return tuple(self.encode(self.render_chat([dict(m) for m in key]), add_special_tokens=False))


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
