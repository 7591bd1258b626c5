"""The web console at `/console`: server-rendered pages for admin and finance keys (no JavaScript)."""
