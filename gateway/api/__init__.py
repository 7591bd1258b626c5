"""The HTTP API, one router per area: the product API, a room per endpoint (`chat/`, `completions/`, `responses/` and
`messages/` (Anthropic's), each its `router` and `serving`, over the shared `serving`: start, stream or complete,
headers), `models`, `embeddings`, `admin` (tenants, keys, audit, engine stats), `finance` (costs, savings, CSV),
`policies`, `router`, `tuning`, `health` and `metrics`. Routes are thin: they take their services from `deps` and
the caller from `auth`, call the pipeline or a store, and shape the response; errors leave through
`gateway.http.errors`. Nothing below this package imports it; the console imports only `deps` and `auth` from it.
"""

__all__ = [
    "admin",
    "auth",
    "chat",
    "completions",
    "deps",
    "embeddings",
    "finance",
    "health",
    "logprobs",
    "messages",
    "metrics",
    "models",
    "params",
    "policies",
    "responses",
    "router",
    "serving",
    "tuning",
]
