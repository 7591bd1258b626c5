"""A tenant's quality against always-large from its shadow verdicts (`router_model.quality`)."""

from __future__ import annotations

import dataclasses

import pytest

from router_model.quality import MIN_VERDICTS, ServedTiers, TenantVerdicts, estimate, recalibrated_offset, wilson


def test_wilsons_interval_matches_its_textbook_values() -> None:
    # 8 of 10: the 95% score interval is (0.4902, 0.9433) (Wilson 1927; Newcombe 1998, method 3)
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson(0, 20) == pytest.approx((0.0, 0.1611), abs=1e-4)  # never below 0 ...
    assert wilson(20, 20)[1] == 1.0  # ... nor above 1
    assert wilson(0, 0) == (0.0, 1.0)


def test_the_ratio_counts_only_what_a_cheaper_tier_served() -> None:
    half = estimate({"small": 0.5}, {"small": (8, 10)})
    assert half is not None
    assert half.ratio == pytest.approx(0.9)  # half the answers large's own, 80% of the rest good enough
    assert (half.low, half.high) == pytest.approx((1 - 0.5 * (1 - 0.4902), 1 - 0.5 * (1 - 0.9433)), abs=1e-4)
    all_large = estimate({}, {"small": (0, 10)})
    assert all_large is not None and all_large.ratio == all_large.low == all_large.high == 1.0
    assert estimate({"small": 0.5}, {}) is None  # no verdict, no estimate


def test_each_cheaper_tier_counts_with_its_own_verdicts() -> None:
    """tiny 20% at 5/10 good enough, small 30% at 9/10: 1 - 0.2 * 0.5 - 0.3 * 0.1 = 0.87; a tier with a share
    but no verdict counts at the pooled rate and leaves its whole share open in the interval."""
    both = estimate({"tiny": 0.2, "small": 0.3}, {"tiny": (5, 10), "small": (9, 10)})
    assert both is not None
    assert both.ratio == pytest.approx(0.87)
    tiny_low, tiny_high = wilson(5, 10)
    small_low, small_high = wilson(9, 10)
    assert both.low == pytest.approx(1 - 0.2 * (1 - tiny_low) - 0.3 * (1 - small_low))
    assert both.high == pytest.approx(1 - 0.2 * (1 - tiny_high) - 0.3 * (1 - small_high))
    assert (both.judged, both.ok, both.cheaper_share) == (20, 14, pytest.approx(0.5))
    assert both.as_dict()["tiers"]["tiny"] == {"share": 0.2, "ok": 5, "judged": 10}
    unjudged = estimate({"tiny": 0.2, "small": 0.3}, {"small": (9, 10)})
    assert unjudged is not None
    assert unjudged.ratio == pytest.approx(1 - 0.2 * 0.1 - 0.3 * 0.1)  # tiny at small's (the pooled) rate
    assert unjudged.low == pytest.approx(1 - 0.2 - 0.3 * (1 - small_low))  # tiny's p anywhere in (0, 1)


def test_the_estimate_moves_when_the_cheaper_tier_gets_worse() -> None:
    """A planted bad small tier: its verdicts turn to "not good enough", and the interval's upper end falls
    below a 0.95 floor once there are enough of them; the rule then aims the curve higher by the shortfall."""
    verdicts = TenantVerdicts()
    for i in range(40):
        verdicts.add("acme", i % 10 != 0)  # 90% good enough
    good = estimate({"small": 0.6}, verdicts.counts("acme"))
    assert recalibrated_offset(good, 0.95, 0.0) is None
    for _ in range(60):
        verdicts.add("acme", False)
    bad = estimate({"small": 0.6}, verdicts.counts("acme"))
    assert good is not None and bad is not None
    assert good.high > 0.95 and bad.ratio < good.ratio and bad.high < 0.95
    assert verdicts.counts("other") == {}  # tenants are counted apart
    assert bad.high < 0.7 and recalibrated_offset(bad, 0.7, 0.0) == pytest.approx(0.7 - bad.ratio)  # the shortfall
    assert recalibrated_offset(bad, 0.7, 0.01) == pytest.approx(0.01 + 0.7 - bad.ratio)  # on top of the last one
    raised = recalibrated_offset(bad, 0.95, 0.0)
    assert raised == pytest.approx(0.05)  # the shortfall is 0.33, but the curve ends at always-large's quality
    assert recalibrated_offset(bad, 0.95, 0.04) == pytest.approx(0.05)  # never aimed past the curve's top
    assert recalibrated_offset(bad, 0.95, 0.05) is None  # already there: no change
    # fresh verdicts only: counted after the recalibration's mark, too few of them decide nothing
    since = verdicts.judged("acme")
    for _ in range(MIN_VERDICTS - 1):
        verdicts.add("acme", False)
    fresh = estimate({"small": 0.6}, verdicts.counts("acme", since))
    assert fresh is not None and fresh.judged == MIN_VERDICTS - 1 and fresh.high < 0.95
    assert recalibrated_offset(fresh, 0.95, raised or 0.0) is None


def test_verdicts_load_from_live_label_rows_that_name_their_tenant() -> None:
    verdicts = TenantVerdicts()
    verdicts.load(
        [
            {"source": "live", "tenant": "acme", "small_ok": True},
            {"source": "live", "tenant": "acme", "served": "small", "small_ok": False},
            {"source": "live", "tenant": "acme", "served": "tiny", "tiny_ok": True},
            {"source": "gsm8k", "small_ok": True},  # offline labels are no tenant's traffic
            {"source": "live", "tenant_id": 3, "small_ok": True},  # a row from before names were kept
        ]
    )
    assert verdicts.counts("acme") == {"small": (1, 2), "tiny": (1, 1)}
    assert verdicts.judged("acme") == 3 and verdicts.counts("acme", since=2) == {"tiny": (1, 1)}


def test_served_tiers_are_a_window_per_tenant() -> None:
    served = ServedTiers(window=4)
    for tier in ("tiny", "large", "small", "small", "small"):
        served.add("acme", tier)
    assert served.shares("acme") == {"large": 0.25, "small": 0.75}  # the first (tiny) fell out of the window
    assert served.shares("other") == {}


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


def test_the_floor_holds_on_each_kind_of_request_alone() -> None:
    """With kinds on the held-out curve, a tool request's threshold keeps the floor on the tool prompts alone: the
    whole curve's threshold, mostly text, would miss it there; a kind with too few held-out prompts gets none."""
    import numpy as np

    from router_model.floor import MIN_KIND_HELDOUT
    from router_model.kinds import TEXT, TOOLS
    from router_model.model import Router

    rng = np.random.default_rng(0)
    # text: small is right wherever P says > 0.3; tools: small is wrong below 0.7, where text trusts it
    p_text, p_tools = rng.uniform(0, 1, 200), rng.uniform(0, 1, 40)
    curve = {
        "p": [*p_text, *p_tools],
        "small_ok": [*(p_text > 0.3), *(p_tools > 0.7)],
        "large_ok": [True] * 240,
        "kind": [TEXT] * 200 + [TOOLS] * 40,
    }
    router = Router(object(), {"heldout_curve": curve}, embedder=object())  # type: ignore[arg-type]
    whole, text, tools = (router.threshold_for_floor(0.95, kind=k) for k in (None, TEXT, TOOLS))
    assert whole is not None and text is not None and tools is not None

    def quality(threshold: float, p: np.ndarray, cut: float) -> float:
        return float(np.where(p < threshold, True, p > cut).mean())

    assert quality(tools[0], p_tools, 0.7) >= 0.95 and quality(text[0], p_text, 0.3) >= 0.95
    assert quality(whole[0], p_tools, 0.7) < 0.95  # the average's threshold, on the tool prompts
    assert tools[0] > whole[0] and tools[1] == float(np.mean(p_tools < tools[0]))
    few = {**curve, "kind": [TEXT] * (240 - MIN_KIND_HELDOUT + 1) + [TOOLS] * (MIN_KIND_HELDOUT - 1)}
    assert Router(object(), {"heldout_curve": few}, embedder=object()).threshold_for_floor(0.95, kind=TOOLS) is None  # type: ignore[arg-type]
    older = {k: v for k, v in curve.items() if k != "kind"}  # a router that kept no kinds: the whole curve
    assert Router(object(), {"heldout_curve": older}, embedder=object()).threshold_for_floor(0.95, kind=TOOLS) == whole  # type: ignore[arg-type]


def test_a_kind_is_known_only_with_enough_held_out_labels() -> None:
    """`router_model.train._kinds`: tools with fewer than MIN_KIND_HELDOUT held-out labels stay out of distribution
    however many training labels they have; a small file whose held-out split is thin knows its main kind."""
    from router_model.examples import Example
    from router_model.floor import MIN_KIND_HELDOUT
    from router_model.kinds import TEXT, TOOLS, TOOLS_NOTE
    from router_model.train import _kinds

    def example(i: int, tools: bool) -> Example:
        note = [{"role": "system", "content": f"{TOOLS_NOTE} 1 tools: f."}] if tools else []
        return Example(f"e{i}", "s", True, True, [*note, {"role": "user", "content": f"q{i}"}])

    train = [example(i, i % 2 == 0) for i in range(200)]
    text = [example(1000 + i, False) for i in range(MIN_KIND_HELDOUT)]
    tools = [example(2000 + i, True) for i in range(MIN_KIND_HELDOUT)]
    assert _kinds(train, text + tools[:-1]) == [TEXT]
    assert _kinds(train, text + tools) == [TEXT, TOOLS]
    assert _kinds(train, text[:3] + tools[:2]) == [TEXT]  # none has enough: the kind most labels are (text 100+3)


def test_the_floor_holds_on_tool_requests_that_need_a_call_however_many_need_none() -> None:
    """`router_model.floor`: tool requests that need no call (a cheaper tier declines rightly, large calls wrongly)
    cannot pay for the ones that need a call: with the groups on the curve, the threshold keeps the floor on each."""
    import numpy as np

    from router_model.kinds import TOOLS
    from router_model.model import Router

    rng = np.random.default_rng(1)
    p_call, p_none = rng.uniform(0, 1, 40), rng.uniform(0, 1, 20)
    curve = {
        "p": [*p_call, *p_none],
        "small_ok": [*(p_call > 0.7), *([True] * 20)],
        "large_ok": [True] * 40 + [False] * 20,
        "kind": [TOOLS] * 60,
        "group": ["tools/call"] * 40 + ["tools/none"] * 20,
    }
    grouped = Router(object(), {"heldout_curve": curve}, embedder=object())  # type: ignore[arg-type]
    mixed = Router(object(), {"heldout_curve": {k: v for k, v in curve.items() if k != "group"}}, embedder=object())  # type: ignore[arg-type]
    (with_groups, _), (without, _) = (r.threshold_for_floor(0.95, kind=TOOLS) for r in (grouped, mixed))  # type: ignore[misc]

    def on_calls(threshold: float) -> float:
        return float(np.where(p_call < threshold, True, p_call > 0.7).mean())

    assert on_calls(without) < 0.95 <= on_calls(with_groups)  # the calls' own quality, against large's 1.0
