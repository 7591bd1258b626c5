"""HTTP routers, one per area: `openai` (the product API), `admin` (tenants, keys, audit, engine stats),
`finance` (costs, savings, CSV), `policies`, `router`, `tuning` and `health`. Routes translate between HTTP
and the pipeline or the stores; their services come from `gateway.deps`, errors leave through `gateway.errors`."""
