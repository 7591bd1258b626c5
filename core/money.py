"""Money units: `Decimal` dollars at the edges, integer units of 1e-10 USD in counters that must add exactly."""

from __future__ import annotations

from decimal import Decimal

__all__ = ["UNITS", "ZERO", "from_units", "to_units"]

UNITS = 10**10  # integer money units (1e-10 USD) for counters that must add exactly
ZERO = Decimal(0)


def to_units(amount: Decimal) -> int:
    units = amount * UNITS
    if units != units.to_integral_value():
        raise ValueError(f"{amount} has more than 10 decimal places")
    return int(units)


def from_units(units: int) -> Decimal:
    return Decimal(units) / UNITS
