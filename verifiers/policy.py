"""A tenant policy's verifiers, built for one request."""

from __future__ import annotations

from policies.policy import Policy, VerifierSettings
from policies.tuning import TunePrompt
from verifiers.agreement import ProgramOfThought, Resample
from verifiers.answers import CodeTests, MathAnswer, Structure
from verifiers.base import Context, Verifier
from verifiers.compose import all_of, any_of
from verifiers.confidence import Confidence
from verifiers.degeneration import Degeneration
from verifiers.hook import VerifierHook
from verifiers.probe import AnswerProbe, ProbeCheck
from verifiers.prompt_examples import PromptExamples

# Final checks by name (the probe, which needs the gateway's trained probe, apart). The `program_of_thought`
# and `resample` checks ask the serving tier (`Context.ask`, which the gateway sets where the checks run).
CHECKS: dict[str, type[Verifier]] = {
    "math": MathAnswer,
    "code": CodeTests,
    "structure": Structure,
    "prompt_examples": PromptExamples,
    "program_of_thought": ProgramOfThought,
    "resample": Resample,
}


def build_verifiers(
    settings: VerifierSettings, choices: int, probe: AnswerProbe | None = None
) -> tuple[Verifier | None, Verifier | None]:
    """The policy's verifiers for a request with `choices` choices: (in-flight, final). In-flight ones run
    in the engine's step loop and are combined as the policy says (confidence judges a vote: it needs two
    choices or more); final answer checks run once the generation has ended, off the engine's thread
    (tests can take seconds), and any failed one escalates. None where there is none. The `probe` check
    needs the gateway's trained `probe`; without one it is left out (policies naming it are refused where
    no probe is loaded, so only a replica missing its probe gets here)."""
    every = settings.every_n_tokens
    in_flight: list[Verifier] = []
    for name in dict.fromkeys(settings.enabled):
        if name == "degeneration":  # the settings' fields are the verifiers' keyword arguments
            in_flight.append(Degeneration(every=every, **settings.degeneration.model_dump()))
        elif name == "confidence" and choices > 1:
            in_flight.append(Confidence(every=every, **settings.confidence.model_dump()))
    final: list[Verifier] = []
    for name in dict.fromkeys(settings.checks):
        if name == "probe":
            if probe is not None:
                final.append(ProbeCheck(probe, settings.probe_threshold))
        else:
            final.append(CHECKS[name]())
    return _combined(in_flight, settings.combine), _combined(final, "any")


def _combined(members: list[Verifier], combine: str) -> Verifier | None:
    if not members:
        return None
    if len(members) == 1:
        return members[0]
    return any_of(*members) if combine == "any" else all_of(*members)


def tuning_hook(policy: Policy, prompt: TunePrompt, request_id: str) -> VerifierHook | None:
    """The in-flight verifiers `policy` puts on a tuning request for `prompt` (policy tuning's `hooks`);
    final checks are left out: they escalate, which tuning does not model."""
    if not policy.verifiers.enabled:
        return None
    verifier, _ = build_verifiers(policy.verifiers, 1)
    return VerifierHook(verifier, Context(prompt=prompt.question, messages=prompt.messages), [request_id])
