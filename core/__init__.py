"""What every layer above the engines shares: settings, SQL storage with its migrations, the audit log,
money units and the MiniLM sentence embedder. It imports nothing above `engines` (tests/test_layers.py).

- `settings`: the gateway's settings (TOML file + `SWITCHBOARD_*` environment) and each tier's.
- `db`: the SQL schema (`db.models`), connections and Alembic migrations (`db.database`, `migrations/`).
- `audit`: who changed what, written in the same transaction as the change.
- `money`: `Decimal` dollars at the edges, integer 1e-10 USD units in counters.
- `embedder`: all-MiniLM-L6-v2 from its registry package, shared by the semantic cache, router and probe.
"""

__all__ = ["audit", "db", "embedder", "money", "settings"]
