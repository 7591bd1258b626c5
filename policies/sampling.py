"""How a tenant's policy shapes one request: its caps, its defaults for what the request left unset, and
its system instruction. The gateway's pipeline and the policy tuner both go through these two functions,
so a tuned policy is measured exactly as the gateway then enforces it."""

from __future__ import annotations

from dataclasses import dataclass

from policies.policy import SamplingLimits


@dataclass(frozen=True)
class Asked:
    """What a request asked for; None: it did not say."""

    max_tokens: int  # after the gateway's own default for requests without one
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    frequency_penalty: float
    presence_penalty: float
    stop: tuple[str, ...]


def _pick(asked: float | None, default: float | None, fallback: float) -> float:
    if asked is not None:
        return asked
    return fallback if default is None else default


def resolve(limits: SamplingLimits, asked: Asked) -> Sampling:
    """The request's settings: its own where it gave them, else the policy's defaults, else the API's
    (temperature and top-p 1, no penalties); then the policy's caps, which bind defaults too."""
    temperature = _pick(asked.temperature, limits.temperature_default, 1.0)
    top_p = _pick(asked.top_p, limits.top_p_default, 1.0)
    if limits.temperature_max is not None:
        temperature = min(temperature, limits.temperature_max)
    if limits.top_p_max is not None:
        top_p = min(top_p, limits.top_p_max)
    max_tokens = asked.max_tokens
    if limits.max_tokens_cap is not None:
        max_tokens = min(max_tokens, limits.max_tokens_cap)
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        frequency_penalty=_pick(asked.frequency_penalty, limits.frequency_penalty_default, 0.0),
        presence_penalty=_pick(asked.presence_penalty, limits.presence_penalty_default, 0.0),
        stop=asked.stop or tuple(limits.default_stop),
    )


def instructed(messages: list[dict[str, str]], instruction: str | None) -> list[dict[str, str]]:
    """`messages` with the policy's instruction: appended to the first system message, or as a new system
    message in front when there is none. A new list; the caller's is left as it was (routing and stored
    prompts keep what the client sent)."""
    if not instruction:
        return messages
    out = [dict(m) for m in messages]
    for m in out:
        if m["role"] == "system":
            m["content"] = f"{m['content'].rstrip()}\n\n{instruction}" if m["content"].strip() else instruction
            return out
    return [{"role": "system", "content": instruction}, *out]
