"""A tenant's quality against always-large from its shadow verdicts (`router_model.quality`)."""

from __future__ import annotations

import pytest

from router_model.quality import TenantVerdicts, estimate, wilson


def test_wilsons_interval_matches_its_textbook_values() -> None:
    # 8 of 10: the 95% score interval is (0.4902, 0.9433) (Wilson 1927; Newcombe 1998, method 3)
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)  # never below 0 ...
    assert wilson(20, 20)[1] == 1.0  # ... nor above 1
    assert wilson(0, 0) == (0.0, 1.0)


def test_the_ratio_counts_only_what_a_cheaper_tier_served() -> None:
    half = estimate(0.5, 8, 10)
    assert half is not None
    assert half.ratio == pytest.approx(0.9)  # half the answers large's own, 80% of the rest good enough
    assert (half.low, half.high) == pytest.approx((1 - 0.5 * (1 - 0.4902), 1 - 0.5 * (1 - 0.9433)), abs=1e-4)
    all_large = estimate(0.0, 0, 10)
    assert all_large is not None and all_large.ratio == all_large.low == all_large.high == 1.0
    assert estimate(0.5, 0, 0) is None  # no verdict, no estimate


def test_the_estimate_moves_when_the_cheaper_tier_gets_worse() -> None:
    """A planted bad small tier: its verdicts turn to "not good enough", and the interval's upper end falls
    below a 0.95 floor once there are enough of them."""
    verdicts = TenantVerdicts()
    for i in range(40):
        verdicts.add("acme", i % 10 != 0)  # 90% good enough
    good = estimate(0.6, *verdicts.counts("acme"))
    for _ in range(60):
        verdicts.add("acme", False)
    bad = estimate(0.6, *verdicts.counts("acme"))
    assert good is not None and bad is not None
    assert good.high > 0.95 and bad.ratio < good.ratio and bad.high < 0.95
    assert verdicts.counts("other") == (0, 0)  # tenants are counted apart


def test_verdicts_load_from_live_label_rows_that_name_their_tenant() -> None:
    verdicts = TenantVerdicts()
    verdicts.load(
        [
            {"source": "live", "tenant": "acme", "small_ok": True},
            {"source": "live", "tenant": "acme", "small_ok": False},
            {"source": "gsm8k", "small_ok": True},  # offline labels are no tenant's traffic
            {"source": "live", "tenant_id": 3, "small_ok": True},  # a row from before names were kept
        ]
    )
    assert verdicts.counts("acme") == (1, 2)
