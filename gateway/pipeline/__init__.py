"""The request pipeline: one path from a validated API request to engine outputs and a usage row.

    admission    principal → policy → route (the tier ladder) → prompts → verifiers → cache lookup
                 → budget reservation of the worst case              → a frozen `Plan`, or a 4xx/429
    run          Plan → engine stream (or the replay of a cached answer) → choice deltas → an `Outcome`
    metering     Outcome → one priced `UsageRecord` → ledger write + budget settle, exactly once
    cache_store  a finished, deterministic answer → the response cache
    single_flight  a request identical to one still generating waits for that one's answer (a hit)
    cascade      a non-streamed answer that fails a final check → retried once on the cascade's tier

`Pipeline` (service) holds the stores and stages and starts each request; `Generation` (run) is one
request being run. The API routes only translate between HTTP and these.
"""

from gateway.pipeline.cascade import Answer
from gateway.pipeline.metering import Meter, ShadowUsage
from gateway.pipeline.plan import Candidate, ChoiceDelta, Outcome, Plan
from gateway.pipeline.refusals import model_not_found
from gateway.pipeline.run import Generation, Watch
from gateway.pipeline.service import Pipeline

__all__ = [
    "Answer",
    "Candidate",
    "ChoiceDelta",
    "Generation",
    "Meter",
    "Outcome",
    "Pipeline",
    "Plan",
    "ShadowUsage",
    "Watch",
    "model_not_found",
]
