"""The gateway, the top layer. Its sub-packages, each importing only those before it:

    http, runtime, accounting    leaves: the HTTP error shape and bodies; tiers and schedules; tenants,
                                 usage rows, the ledger, reports and metrics counters
    adapters                     the tenants' LoRA adapters: names, files, rows, loading onto engines
    cache, tool_calls            the response caches; tool calls checked, constrained and parsed (→ http)
    routing                      `model: "auto"`, shadow runs, the quality floor (→ http, accounting)
    pipeline                     admission → run → metering, single flight, the cascade (→ all above)
    api                          the HTTP routes, their dependencies and auth (→ all above)
    console                      the web console (→ api's deps and auth, and below)

`app.py` (`create_app`) puts them together; `cli/` (the `switchboard` command) sits on top of it. Only this
package and the tests import it (tests/test_layers.py holds both orders).
"""

__all__ = [
    "accounting",
    "adapters",
    "api",
    "app",
    "cache",
    "cli",
    "console",
    "http",
    "pipeline",
    "routing",
    "runtime",
    "tool_calls",
]
