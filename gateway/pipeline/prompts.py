"""A request body → what the engines run (token ids, sampling parameters, a grammar), and what the
router, the verifiers and the response cache's key read from it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from engines.protocol import RequestRejected, TierEngine
from engines.sampling import SamplingParams
from engines.structured import Grammar, GrammarError
from engines.tokenizer import ChatTemplateError, Tokenizer
from gateway.adapters import AdapterRecord
from gateway.http.errors import invalid
from gateway.http.schemas import MAX_SCHEMA_CHARS, ChatCompletionRequest, CompletionRequest, ResponseFormat
from gateway.pipeline.wires import Wire
from gateway.routing.stage import RouteDecision
from gateway.tool_calls import (
    CallSpec,
    ToolRequest,
    fallback_messages,
    format_for,
    renders_tools,
    structural_tag,
    template_messages,
)
from policies.policy import Policy
from policies.sampling import Asked, instructed, resolve
from verifiers.base import Context

Body = ChatCompletionRequest | CompletionRequest
T = TypeVar("T")

# Shorter prompts tokenize in well under a millisecond, cheaper on the event loop than a hand-off to a
# worker thread (~0.14 ms); longer ones go to a thread so the loop keeps serving others meanwhile.
INLINE_TOKENIZE_CHARS = 2048

# Request fields that change the answer, besides the sampling parameters: part of the cache key.
_ANSWER_FIELDS = ("functions", "response_format")
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")  # declared chat fields that change the answer


@dataclass(frozen=True)
class Prepared:
    """A request routed and tokenized for the tier that will serve it."""

    endpoint: str  # chat.completions | completions
    id_prefix: str  # chatcmpl | cmpl
    engine: TierEngine  # the requested (or routed) tier's: the prompts are its token ids
    prompts: list[list[int]]
    max_tokens: int | None  # as sent
    conversation: Any  # what the cache key reads: the chat as the model sees it, or the prompt as sent
    conversations: list[Any]  # what the router decided on (and stores, and shadow runs re-ask)
    route: RouteDecision | None = None
    grammar: Grammar | None = None  # compiled for `engine`'s vocabulary
    calls: CallSpec | None = None  # answers are parsed for tool calls
    asked: str | None = None  # the model name the client sent (an alias's, before it named the tier)
    adapter: AdapterRecord | None = None  # the LoRA adapter it runs under (`gateway.pipeline.adapter_choice`)


async def tokenize(chars: int, fn: Callable[..., T], *args: Any) -> T:
    if chars < INLINE_TOKENIZE_CHARS:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, str]]:
    """The client's conversation as plain text turns, what the router reads and stores (`developer` is the
    system turn, a tool's result a user turn)."""
    roles = {"developer": "system", "tool": "user"}
    return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in body.messages]


def chat_input(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: ToolRequest | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The turns and tools for the tier's chat template: the template's own rendering where it knows tools, else
    the Hermes tools block and turns (`tool_calls.fallback_messages`)."""
    offered = list(tools.tools) if tools is not None else []
    if renders_tools(tokenizer.chat_template):
        return messages, offered or None
    if offered or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return fallback_messages(messages, offered), None
    return messages, None


async def tool_grammar(engine: TierEngine, tools: ToolRequest) -> tuple[Grammar | None, CallSpec]:
    """The grammar that keeps the tier's calls well formed, and how its answers are parsed. A remote tier has no
    grammar: the server behind it generates unconstrained, and its text is parsed the same way."""
    fmt = format_for(engine.tokenizer.chat_template)
    spec = CallSpec(fmt, tools.names)
    compiler = await anyio.to_thread.run_sync(lambda: engine.grammars)  # built on first use: ~0.1-1 s
    if compiler is None:
        return None, spec
    tag = structural_tag(fmt, list(tools.tools), tools.choice, tools.parallel)
    try:
        compiled = await anyio.to_thread.run_sync(compiler.structural_tag, tag)
    except GrammarError as exc:
        raise invalid(_culprit(compiler, tools) or str(exc), param="tools") from None
    return compiled, spec


def _culprit(compiler: Any, tools: ToolRequest) -> str | None:
    """Which function's `parameters` the compiler refuses, and why (the structural tag's error names none)."""
    for i, tool in enumerate(tools.tools):
        try:
            compiler.json_schema(tool["function"].get("parameters") or {"type": "object"})
        except GrammarError as exc:
            return f"tools[{i}] (`{tool['function']['name']}`): its `parameters` {exc}"
    return None


async def _compiler(engine: TierEngine, param: str) -> Any:
    compiler = await anyio.to_thread.run_sync(lambda: engine.grammars)  # built on first use: ~0.1-1 s
    if compiler is None:
        raise invalid(
            f"Tier `{engine.name}` cannot constrain its output; `{param}` needs an in-process tier.",
            param=param,
            code="unsupported_parameter",
        )
    return compiler


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def prompt_conversations(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """Text prompts as the one-turn conversations the router reads; token ids it cannot read."""
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not all(isinstance(t, str) for t in texts):
        raise invalid("`model: auto` routes text prompts; name a tier to send token ids.", param="prompt")
    return [[{"role": "user", "content": t}] for t in texts]


async def grammar(engine: TierEngine, fmt: ResponseFormat | None) -> Grammar | None:
    """The token grammar a `response_format` asks for (compiled off the event loop), or None for text."""
    if fmt is None or fmt.type == "text":
        return None
    compiler = await _compiler(engine, "response_format")
    try:
        if fmt.type == "json_object":
            return await anyio.to_thread.run_sync(compiler.any_json)
        if fmt.type == "json_schema":
            assert fmt.json_schema is not None
            schema = fmt.json_schema.schema_
            if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
                raise GrammarError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters as JSON")
            return await anyio.to_thread.run_sync(compiler.json_schema, schema)
        assert fmt.regex is not None
        return await anyio.to_thread.run_sync(compiler.regex, fmt.regex)
    except GrammarError as exc:
        raise invalid(str(exc), param="response_format") from None


def sampling_params(
    body: Body, engine: TierEngine, prompt: list[int], max_tokens: int | None, policy: Policy, default_max: int | None
) -> tuple[SamplingParams, int]:
    """The engine's sampling parameters after the policy's clamps, and the max tokens asked for."""
    room = engine.max_model_len - len(prompt)
    if max_tokens is None:
        max_tokens = min(room, default_max or room)
        max_tokens = max(max_tokens, 1)  # no room left: the context check below explains
    given = body.model_fields_set  # a penalty the client left out takes the policy's default
    s = resolve(
        policy.sampling,
        Asked(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            frequency_penalty=body.frequency_penalty if "frequency_penalty" in given else None,
            presence_penalty=body.presence_penalty if "presence_penalty" in given else None,
            stop=tuple(body.stop_list),
        ),
    )
    try:
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            stop=s.stop,
            logprobs=logprobs_asked(body),
            logit_bias=logit_bias(body, engine),
        )
        engine.check(prompt, params.max_tokens)
    except RequestRejected as exc:
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise invalid(str(exc), param=param, code=exc.code) from None
    except ValueError as exc:
        raise invalid(str(exc)) from None
    return params, min(max_tokens, max(room, 1))


def logprobs_asked(body: Body) -> int | None:
    """Alternatives per token the response shows (0: the chosen token's only), or None for no logprobs."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("`top_logprobs` needs `logprobs: true`.", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def logit_bias(body: Body, engine: TierEngine) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs, each id checked against the tier's vocabulary."""
    if not body.logit_bias:
        return ()
    vocab = len(engine.tokenizer.hf)
    out = []
    for key, bias in body.logit_bias.items():
        if not (key.isdigit() and int(key) < vocab):
            raise invalid(f"`logit_bias` keys are token ids of this tier's vocabulary, 0 to {vocab - 1}; "
                          f"{key!r} is not one.", param="logit_bias")  # fmt: skip
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def answer_params(body: Body, params: SamplingParams) -> dict[str, Any]:
    """What the cache must key on, after the policy's clamps (so a clamp cannot hand back another's answer)."""
    extra = body.model_extra or {}
    return {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "stop": list(params.stop),
        "seed": body.seed,
        "n": body.n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "logit_bias": [list(pair) for pair in params.logit_bias] or None,
        **{k: extra[k] for k in _ANSWER_FIELDS if extra.get(k) is not None},
        **{k: _json(getattr(body, k)) for k in _TOOL_FIELDS if getattr(body, k, None) is not None},
        **({"response_format": fmt} if (fmt := response_format(body)) is not None else {}),
    }


def _json(value: Any) -> Any:
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def response_format(body: Body) -> dict[str, Any] | None:
    """The request's `response_format` as JSON, None for free text (the cache key and the verifiers read it)."""
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        return None
    return fmt.model_dump(by_alias=True, exclude_none=True)


def verifier_context(body: Body, index: int) -> Context:
    tests = (body.model_extra or {}).get("tests")  # extension: code that checks a code answer (`code` check)
    return Context(
        prompt=_prompt_text(body, index),
        response_format=response_format(body),
        tests=tests if isinstance(tests, str) else None,
    )


def _prompt_text(body: Body, index: int) -> str:
    """What verifiers read as the question: the last user turn, or prompt `index` when it is text."""
    if isinstance(body, ChatCompletionRequest):
        return next((m.text() for m in reversed(body.messages) if m.role == "user"), "")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    text = prompts[index] if index < len(prompts) else ""
    return text if isinstance(text, str) else ""


async def chat_prompt(
    engine: TierEngine, body: ChatCompletionRequest, policy: Policy, tools: ToolRequest | None, wire: Wire
) -> tuple[list[dict[str, Any]], list[int]]:
    """The conversation as the model sees it, and its token ids. The model (and the cache key) see the policy's
    instruction; routing and stored prompts see the client's."""
    shown = instructed(template_messages(body), policy.sampling.system_instruction)
    turns, offered = chat_input(engine.tokenizer, shown, tools)
    chars = sum(len(m["content"]) for m in turns) + (len(str(offered)) if offered else 0)
    try:
        return shown, await tokenize(chars, engine.tokenizer.encode_chat, turns, offered)
    except ChatTemplateError as exc:
        raise invalid(str(exc), param=wire.prompt_field) from None
