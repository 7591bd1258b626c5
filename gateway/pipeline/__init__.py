"""The request pipeline: one path from a validated API request to engine outputs and a usage row.

    admission    principal → policy → route (the tier ladder) → prompts → verifiers → cache lookup
                 → budget reservation of the worst case              → a frozen `Plan`, or a 4xx/429
    run          Plan → engine stream (or the replay of a cached answer) → choice deltas → an `Outcome`
    metering     Outcome → one priced `UsageRecord` → ledger write + budget settle, exactly once
    cache_store  a finished, deterministic answer → the response cache
    single_flight  a request identical to one still generating waits for that one's answer (a hit)
    cascade      a non-streamed answer that fails a final check → retried once on the cascade's tier
    followups    once the response is out: the routed conversation stored, a shadow run offered

Beside them: `plan` (what admission decides, what a run ends with), `choices` (deltas and candidate tiers),
`streams` (a primed engine stream, a replay, `Watch`), `prompts` (a request's prompts and tool calls),
`refusals` (the 4xx a request can meet), `policy_check` (a policy as this gateway would serve it), `wires`
(the APIs a chat-shaped request arrives through), `prompt_log` (the one place prompt text is logged, where a
tenant opted in) and `embeddings` (`/v1/embeddings`, metered). `Pipeline` (service) holds the stores and
stages, starts each request and runs a non-streamed one to its `Answer`; `Generation` (run) is one request
being run. The API routes only translate between HTTP and these.
"""

from gateway.pipeline.choices import Candidate, ChoiceDelta
from gateway.pipeline.metering import Meter
from gateway.pipeline.plan import Outcome, Plan
from gateway.pipeline.refusals import model_not_found
from gateway.pipeline.run import Generation, Watch
from gateway.pipeline.service import Answer, Pipeline
from gateway.pipeline.wires import CHAT, MESSAGES, RESPONSES, Wire

__all__ = [
    "CHAT",
    "MESSAGES",
    "RESPONSES",
    "Answer",
    "Candidate",
    "ChoiceDelta",
    "Generation",
    "Meter",
    "Outcome",
    "Pipeline",
    "Plan",
    "Watch",
    "Wire",
    "model_not_found",
]
