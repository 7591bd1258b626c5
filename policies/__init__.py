"""Tenant policies, budgets, sampling limits and policy tuning (arrive with the policies issue)."""
