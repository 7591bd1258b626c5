"""HTTP routers, one per area: `openai` (the product API) and `health`."""
