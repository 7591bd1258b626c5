"""The gateway, the top layer: the FastAPI app (`app.create_app`, typed dependencies in `deps`), the HTTP API
(`api/`: the OpenAI routes, admin, finance, policies, router, tuning, health), the request pipeline
(`pipeline/`: admission → run → metering, cascade, cache store), the response caches (`cache_stage`,
`response_cache`, `semantic_cache`, `normalize`), routing and shadow relabeling (`routing`, `shadow`), the
ledger (`ledger`, `usage_record`, `usage_spool`, `reports`), tenants and keys (`tenants`, `auth`), metrics
and logs, the console (`console/`) and the `switchboard` CLI (`cli/`). Only this package and the tests
import it (tests/test_layers.py).
"""
