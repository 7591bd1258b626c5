"""Finance reports, always from the daily rollup (never the raw ledger): cost by day, tier and model,
and savings by lever against the always-large counterfactual."""

from __future__ import annotations

import csv
import io
from datetime import date
from decimal import Decimal
from typing import Any, Literal

from sqlalchemy import func, select

from core.db.database import Database
from core.db.models import Tenant, UsageDaily
from gateway.accounting import ledger

GroupBy = Literal["day", "tier", "model"]
COUNTS = ("requests", *ledger.COUNTS)
AMOUNTS = ledger.AMOUNTS[:2]  # cost and counterfactual; the savings are reported by lever
LEVERS = ("cache", "routing", "speculation", "verifier", "policy")


def _where(tenant_ids: list[int] | None, start: date | None, end: date | None) -> list:
    clauses = []
    if tenant_ids is not None:
        clauses.append(UsageDaily.tenant_id.in_(tenant_ids))
    if start is not None:
        clauses.append(UsageDaily.day >= start)
    if end is not None:
        clauses.append(UsageDaily.day <= end)
    return clauses


def costs(
    db: Database,
    tenant_ids: list[int] | None,
    start: date | None = None,
    end: date | None = None,
    group_by: tuple[GroupBy, ...] = ("day",),
) -> list[dict[str, Any]]:
    """One row per tenant and group: requests, tokens by kind, cost and counterfactual cost."""
    keys = [Tenant.name.label("tenant"), *(getattr(UsageDaily, g) for g in group_by)]
    sums = [func.sum(getattr(UsageDaily, c)).label(c) for c in (*COUNTS, *AMOUNTS)]
    q = (
        select(*keys, *sums)
        .join(Tenant, Tenant.id == UsageDaily.tenant_id)
        .where(*_where(tenant_ids, start, end))
        .group_by(*keys)
        .order_by(*keys)
    )
    with db.session() as s:
        rows = s.execute(q).mappings().all()
    return [_clean(dict(r)) for r in rows]


def savings(
    db: Database, tenant_ids: list[int] | None, start: date | None = None, end: date | None = None
) -> list[dict[str, Any]]:
    """Per tenant: cost, counterfactual, saved in all and by lever."""
    cols = [func.sum(getattr(UsageDaily, c)).label(c) for c in (*AMOUNTS, *(f"saved_{lv}" for lv in LEVERS))]
    q = (
        select(Tenant.name.label("tenant"), func.sum(UsageDaily.requests).label("requests"), *cols)
        .join(Tenant, Tenant.id == UsageDaily.tenant_id)
        .where(*_where(tenant_ids, start, end))
        .group_by(Tenant.name)
        .order_by(Tenant.name)
    )
    with db.session() as s:
        rows = s.execute(q).mappings().all()
    out = []
    for r in rows:
        row = _clean(dict(r))
        row["saved"] = row["counterfactual_cost"] - row["cost"]
        row["saved_share"] = float(row["saved"] / row["counterfactual_cost"]) if row["counterfactual_cost"] else 0.0
        out.append(row)
    return out


def to_csv(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:f}" if isinstance(v, Decimal) else v) for k, v in row.items()})
    return buf.getvalue()


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    """Sums of nothing are NULL; SQLite's dates come back as strings."""
    for k, v in row.items():
        if k in AMOUNTS or k.startswith("saved_"):
            row[k] = v if v is not None else Decimal(0)
        elif k in COUNTS:
            row[k] = int(v or 0)
        elif k == "day" and isinstance(v, str):
            row[k] = date.fromisoformat(v)
    return row
