"""Token log-probabilities in OpenAI's two shapes: chat's `logprobs.content[]` (token, logprob, bytes, top
alternatives) and completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset).

The numbers are the serving model's log-softmax over its vocabulary at each generated position, before
temperature, top-k/top-p, penalties and `logit_bias` (after a grammar's mask, where `response_format` or tools
constrain the output): the model's own belief in the token it chose, whatever the sampler did with it.
"""

from __future__ import annotations

from engines.request import TokenLogprob
from engines.tokenizer import Tokenizer
from gateway.http.schemas import ChatLogprobs, CompletionLogprobs, TokenLogprobOut, TopLogprob


def _top(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    raw = tokenizer.token_bytes(token_id)
    return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))


def _shown(tokens: list[TokenLogprob] | tuple[TokenLogprob, ...], tokenizer: Tokenizer) -> list[TokenLogprob]:
    """The tokens of the answer's text: the end-of-turn token is generated (and billed) but, as at OpenAI, not
    listed."""
    return [t for t in tokens if t.token_id not in tokenizer.eos_token_ids]


def chat_logprobs(tokens: list[TokenLogprob] | tuple[TokenLogprob, ...], tokenizer: Tokenizer, k: int) -> ChatLogprobs:
    content = []
    for t in _shown(tokens, tokenizer):
        chosen = _top(tokenizer, t.token_id, t.logprob)
        alternatives = [_top(tokenizer, i, p) for i, p in t.top[:k]]
        content.append(TokenLogprobOut(**chosen.model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def completion_logprobs(
    tokens: list[TokenLogprob] | tuple[TokenLogprob, ...], tokenizer: Tokenizer, k: int, offset: int = 0
) -> CompletionLogprobs:
    """`offset`: the characters of the choice's text before these tokens (a stream's earlier chunks)."""
    tokens = _shown(tokens, tokenizer)
    texts = [tokenizer.token_bytes(t.token_id).decode("utf-8", errors="replace") for t in tokens]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    top = None
    if k:
        top = [{_top(tokenizer, i, p).token: p for i, p in t.top[:k]} for t in tokens]
    return CompletionLogprobs(tokens=texts, token_logprobs=[t.logprob for t in tokens], top_logprobs=top,
                              text_offset=offsets)  # fmt: skip
