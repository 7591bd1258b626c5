"""Path and query parameters the admin, policy and finance routes share, typed as tightly as the data.

A name that cannot be a tenant's, or a date that is not `YYYY-MM-DD`, is a 422 naming the parameter
before anything reaches SQL (PostgreSQL refuses a NUL character with an error of its own), and the
OpenAPI document says exactly what is accepted.
"""

from __future__ import annotations

import re
from datetime import date
from typing import Annotated

from fastapi import Path, Query
from pydantic import BeforeValidator

# As gateway.accounting.tenants names tenants and issues keys (`sk-sb-` and URL-safe base64).
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$"
KEY_PREFIX_PATTERN = r"^sk-sb-[A-Za-z0-9_\-]{10,43}$"

TenantName = Annotated[str, Path(pattern=TENANT_PATTERN, description="a tenant's name")]
TenantFilter = Annotated[str | None, Query(pattern=TENANT_PATTERN, description="only this tenant")]
KeyPrefix = Annotated[str, Path(pattern=KEY_PREFIX_PATTERN, description="the key's first 16 characters (or all of it)")]
TierName = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.\-]{1,32}$", description="a tier's name")]
# As gateway.adapters.names registers them.
AdapterName = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9._\-]{0,63}$", description="an adapter's name")]

_ISO_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _iso_date(value: object) -> object:
    # pydantic would also read "0" or "1700000000" as a Unix time; the document promises `format: date`.
    if isinstance(value, str) and not _ISO_DATE.fullmatch(value):
        raise ValueError("dates are written YYYY-MM-DD")
    return value


IsoDate = Annotated[date, BeforeValidator(_iso_date)]
