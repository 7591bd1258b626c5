"""Tokenizing, chat templates and end-of-turn ids for one model directory (via transformers)."""

from __future__ import annotations

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


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        model_dir = Path(model_dir)
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        self.backend: tokenizers.Tokenizer = self.hf.backend_tokenizer
        self.eos_token_ids = frozenset(_eos_ids(model_dir, self.hf.eos_token_id))

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
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> set[int]:
    ids = {tokenizer_eos} if tokenizer_eos is not None else set()
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
