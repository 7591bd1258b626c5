"""Which tier serves `model: "auto"`, and how the gateway learns whether it chose well: the routing stage
(`stage`), the small tier's hidden state as the router's input (`hidden`), the router trained after startup
where there is none (`bootstrap`), shadow runs that judge cheaper answers on the large tier (`shadow`, their
jobs, rows and billing in `shadow_rows`) and the tenant's quality floor they feed (`quality_floor`).
Imports `gateway.http` and `gateway.accounting` only.
"""

__all__ = ["bootstrap", "hidden", "quality_floor", "shadow", "shadow_rows", "stage"]
