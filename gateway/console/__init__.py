"""The web console at `/console`: server-rendered pages for admin and finance keys (no JavaScript). Pages
read the stores and the pipeline; from `gateway.api` they take only `deps` and `auth`."""

__all__ = ["account", "admin", "audit", "chart", "finance", "pages", "render", "routing", "routing_plan", "session"]
