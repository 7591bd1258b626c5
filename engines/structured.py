"""Structured output: token masks compiled from a JSON schema, any JSON, a regex or a structural tag (xgrammar).

xgrammar (vLLM's and SGLang's default) compiles a grammar against the tokenizer's vocabulary once; a
matcher per sequence then gives, before each sampled token, the set of tokens that keep the output a
valid prefix, and is advanced by the token sampled. Masked logits are -inf, so every sampler path
(greedy, temperature, top-p, penalties) can only pick an allowed token. Once the grammar is complete
only the end-of-turn tokens are allowed, so a constrained answer ends by itself. Constrained sequences
do not speculate (a draft would have to be checked token by token against the grammar).

Output is compact JSON (no free whitespace): whitespace runs were where small models looped. A grammar
cannot close a JSON value that `max_tokens` cuts off; the gateway leaves enough room for the schema.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping
from typing import Any

import torch

from engines.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A schema or pattern the grammar compiler cannot use; the message says why."""


class Constraint:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        import xgrammar as xgr

        self.grammar = grammar
        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits (one row, in place) of every token the grammar does not allow to -inf."""
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask)
        row = logits.view(1, -1)
        xgr.apply_token_bitmask_inplace(row, self._bitmask, vocab_size=self.grammar.vocab_size)

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the grammar")  # a masking bug

    @property
    def complete(self) -> bool:
        return self._matcher.is_terminated()


class Grammar:
    """A compiled grammar: shared by every sequence that uses it (each gets a `Constraint`)."""

    def __init__(self, compiled: Any, vocab_size: int, description: str) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.description = description

    def constraint(self) -> Constraint:
        return Constraint(self)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and model vocabulary; compiled grammars are remembered."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf, vocab_size=vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compile = functools.lru_cache(maxsize=256)(self._compile_uncached)

    def json_schema(self, schema: Mapping[str, Any]) -> Grammar:
        # Key order kept: an object's properties are generated in the order the schema lists them (sorted,
        # a tool's `end_location` came before its `start_location`, against the model's habit).
        return self._compile("schema", json.dumps(schema))

    def any_json(self) -> Grammar:
        """Any JSON object (OpenAI's `json_object`), compact: the free-whitespace JSON grammar let small
        models emit whitespace until `max_tokens` cut the object off."""
        return self._compile("schema", json.dumps({"type": "object"}))

    def regex(self, pattern: str) -> Grammar:
        return self._compile("regex", pattern)

    def structural_tag(self, tag: Mapping[str, Any]) -> Grammar:
        """xgrammar's structural tag (its JSON form): free text and tagged spans, each span held to its own
        format (tool calls: `gateway.tool_calls.grammar`)."""
        return self._compile("structural tag", json.dumps(tag))

    def _compile_uncached(self, kind: str, spec: str) -> Grammar:
        import xgrammar as xgr

        try:
            with self._lock:
                if kind == "schema":
                    compiled = self._compiler.compile_json_schema(spec, any_whitespace=False)
                elif kind == "structural tag":
                    compiled = self._compiler.compile_structural_tag(spec)
                else:
                    compiled = self._compiler.compile_regex(spec)
        except (RuntimeError, ValueError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as exc:
            raise GrammarError(f"cannot compile this {kind}: {exc}") from None
        return Grammar(compiled, self.vocab_size, kind)
