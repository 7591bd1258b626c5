"""Who pays and what they paid: tenants, keys and principals (`tenants`), the priced usage row
(`record`), its write-ahead spool (`spool`), the ledger that writes it once (`ledger`), finance reports over
it (`reports`), and the Prometheus counters (`metrics`; the scrape route is `gateway.api.metrics`). A leaf:
it imports no other gateway sub-package.
"""

__all__ = ["ledger", "metrics", "record", "reports", "spool", "tenants"]
