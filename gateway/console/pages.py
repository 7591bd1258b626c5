"""The console's pages: sign in with an admin or finance key, then manage tenants, keys and policies,
read the audit log, and see costs and savings. Sessions, CSRF and roles live in `session`; the router,
templates and page helpers in `render`.

Each module below adds its pages to `router` as it is imported: in this order (the names sort so).
"""

from __future__ import annotations

from gateway.console import account, admin, audit, finance, routing  # noqa: F401  (adds their routes)
from gateway.console.render import router

__all__ = ["router"]
