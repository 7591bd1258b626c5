"""A tenant's quality against always-large from its shadow verdicts (`router_model.quality`)."""

from __future__ import annotations

import dataclasses

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


def test_a_floor_becomes_the_threshold_with_the_fewest_large_calls_that_keep_it() -> None:
    """`Router.threshold_for_floor`: on the held-out curve kept in the router's metadata, the routed quality
    is at least the floor's share of always-large's, and a higher floor never sends fewer requests large."""
    import numpy as np

    from router_model.encoder import RouterEncoder
    from router_model.examples import split_examples
    from router_model.synthetic import synthetic_examples
    from router_model.train import train_router

    train, heldout = split_examples(synthetic_examples(160, seed=2), test_size=0.25, seed=0)
    router = train_router(train, heldout, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",)).router
    curve = router.metadata["heldout_curve"]
    assert len(curve["p"]) == len(heldout) == len(curve["small_ok"]) == len(curve["large_ok"])
    p, small, large = (np.asarray(curve[k], float) for k in ("p", "small_ok", "large_ok"))
    shares = []
    for ratio in (0.7, 0.9, 0.95, 1.0):
        found = router.threshold_for_floor(ratio)
        assert found is not None
        threshold, share = found
        routed = np.where(p < threshold, large, small).mean()  # large where P(small ok) falls short
        assert routed >= ratio * large.mean() - 1e-9 or share == 1.0, (ratio, routed)
        assert share == np.mean(p < threshold)
        shares.append(share)
    assert shares == sorted(shares) and shares[0] < shares[-1]
    # a router trained before the curve was kept: no floor to compute
    older = dataclasses.replace(router, metadata={k: v for k, v in router.metadata.items() if k != "heldout_curve"})
    assert older.threshold_for_floor(0.95) is None
