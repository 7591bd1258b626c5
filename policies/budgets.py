"""Budgets and rate limits decided before a request runs, settled after it ran.

Admission reserves the worst case (every prompt token uncached, every choice running to its
effective max tokens, at the tier's price) on every counter at once: the tenant's daily and monthly
spend in money and tokens, and the per-minute request and token counters of the key and the tenant.
If a hard budget or a rate limit would be passed, nothing is reserved and the request gets a 429.
Settling replaces the reservation with the actual cost. So concurrent requests can never together
spend past a hard budget: each one's worst case was already counted when it was let in.

Spend counters are a cache of SQL (the ledger's daily rollup is the truth): a missing counter (a new
day or month, a restarted Redis) is loaded from SQL before deciding, and `reconcile` rewrites every
counter as SQL's total plus the reservations still in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal

import anyio
from redis.exceptions import RedisError
from sqlalchemy import func, select

from gateway.db.database import Database
from gateway.db.models import UsageDaily
from gateway.errors import APIError
from policies.counters import Counters, Item, Missing
from policies.policy import Budget, Policy
from policies.pricing import from_units, to_units

log = logging.getLogger(__name__)

DAY_TTL = 3 * 86400
MONTH_TTL = 33 * 86400
MINUTE_TTL = 120


@dataclass(frozen=True)
class Reservation:
    resv_id: str
    items: list[Item]
    money_units: int  # the worst-case cost reserved
    tokens: int  # the worst-case tokens reserved


def period_window(period: str, day: date) -> tuple[str, date, date]:
    """(window name, first day, last day) of the budget period containing `day` (UTC)."""
    if period == "daily":
        return day.isoformat(), day, day
    first = day.replace(day=1)
    nxt = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first.strftime("%Y-%m"), first, date.fromordinal(nxt.toordinal() - 1)


class Budgets:
    RETRY_AFTER = 1.0  # seconds without trying the counters after they failed

    def __init__(self, db: Database, counters: Counters, namespace: str = "sb") -> None:
        self.db = db
        self.counters = counters
        self.ns = namespace
        self._down_until = 0.0  # while the counters are known down, don't make each request wait on them
        self._missed = False  # requests ran uncounted: rebuild the counters from SQL once they are back
        self._repair: asyncio.Task | None = None

    def spend_key(self, tenant_id: int, period: str, window: str, unit: str) -> str:
        return f"{self.ns}:spend:{tenant_id}:{period}:{window}:{unit}"

    async def admit(
        self,
        resv_id: str,
        policy: Policy,
        tenant_id: int,
        key_id: int,
        worst_money: Decimal,
        worst_tokens: int,
        now: float | None = None,
    ) -> Reservation:
        now = time.time() if now is None else now
        today = datetime.fromtimestamp(now, UTC).date()
        minute = int(now // 60)
        money = to_units(worst_money)
        budgets = {b.period: b for b in policy.budgets}
        items: list[Item] = []
        for period in ("daily", "monthly"):
            window, _, _ = period_window(period, today)
            b = budgets.get(period)
            hard = b is not None and b.hard
            ttl = DAY_TTL if period == "daily" else MONTH_TTL
            m_limit = to_units(b.money) if hard and b.money is not None else None  # type: ignore[union-attr]
            t_limit = b.tokens if hard else None  # type: ignore[union-attr]
            items.append(Item(self.spend_key(tenant_id, period, window, "money"), money, m_limit, ttl, True))
            items.append(Item(self.spend_key(tenant_id, period, window, "tokens"), worst_tokens, t_limit, ttl, True))
        rl = policy.rate_limits
        for scope, ident, rpm, tpm in (
            ("key", key_id, rl.key_rpm, rl.key_tpm),
            ("tenant", tenant_id, rl.tenant_rpm, rl.tenant_tpm),
        ):
            if rpm is not None:
                items.append(Item(f"{self.ns}:rate:{scope}:{ident}:{minute}:requests", 1, rpm, MINUTE_TTL))
            if tpm is not None:
                items.append(Item(f"{self.ns}:rate:{scope}:{ident}:{minute}:tokens", worst_tokens, tpm, MINUTE_TTL))
        try:
            if time.monotonic() < self._down_until:
                raise RedisError("budget counters are down (backing off)")
            for _ in range(3):
                try:
                    refused = await self.counters.reserve(resv_id, items)
                    break
                except Missing as missing:
                    await self._seed(missing.keys, tenant_id, today)
            else:
                raise RuntimeError("budget counters could not be seeded")
        except (RedisError, OSError, RuntimeError) as exc:
            if time.monotonic() >= self._down_until:
                log.warning("budget counters unavailable (%s); retrying in %.0f s", exc, self.RETRY_AFTER)
            self._down_until = max(self._down_until, time.monotonic() + self.RETRY_AFTER)
            if any(it.limit is not None for it in items):  # fail closed: a hard budget or a limit is a promise
                raise APIError(
                    503, "Budgets cannot be checked right now; retry shortly.", code="budget_unavailable"
                ) from exc
            self._missed = True  # nothing to enforce: serve it; the ledger still records it
            return Reservation(resv_id, [], 0, 0)
        if self._missed and self._repair is None:  # back after an outage: count what ran meanwhile
            self._missed = False
            self._repair = asyncio.get_running_loop().create_task(self._reconcile_after_outage())
        if refused is not None:
            raise _refusal(items[refused.index], refused.current, budgets, now)
        return Reservation(resv_id, items, money, worst_tokens)

    async def settle(self, resv: Reservation, cost: Decimal, tokens: int) -> None:
        """Replace the reservation by what was spent. Never raises: the ledger row is already written,
        and if the counters cannot be reached, `reconcile` rebuilds them from it."""
        try:
            await self._settle(resv, cost, tokens)
        except (RedisError, OSError):
            log.exception("could not settle reservation %s; `switchboard budgets reconcile` repairs it", resv.resv_id)

    async def _reconcile_after_outage(self) -> None:
        try:
            log.info("budget counters are back: rebuilt %d from the ledger", await self.reconcile())
        except Exception:  # the next outage's recovery tries again
            log.exception("rebuilding the budget counters after an outage failed")
            self._missed = True
        finally:
            self._repair = None

    async def _settle(self, resv: Reservation, cost: Decimal, tokens: int) -> None:
        if not resv.items:  # admitted uncounted while the counters were down
            return
        money = to_units(cost)
        deltas = []
        for it in resv.items:
            if it.key.endswith(":money"):
                deltas.append((it.key, money - resv.money_units))
            elif it.key.endswith(":tokens"):
                deltas.append((it.key, tokens - resv.tokens))
            else:
                deltas.append((it.key, 0))
        await self.counters.settle(resv.resv_id, deltas)

    async def spent(self, tenant_id: int, period: str, day: date | None = None) -> tuple[Decimal, int]:
        """(money, tokens) counted this period, reservations in flight included."""
        day = day or datetime.now(UTC).date()
        window, _, _ = period_window(period, day)
        keys = [self.spend_key(tenant_id, period, window, u) for u in ("money", "tokens")]
        values = [await self.counters.get(k) for k in keys]
        if None in values:
            await self._seed(keys, tenant_id, day)
            values = [await self.counters.get(k) for k in keys]
        return from_units(values[0] or 0), values[1] or 0

    async def reconcile(self, stale_after: float = 3600.0) -> int:
        """Rewrite every spend counter of the current day and month as SQL's total plus the
        reservations still in flight; reservations older than `stale_after` seconds (a crashed
        process's) are dropped. Returns how many counters were rewritten."""
        ages = await self.counters.reservation_ages()
        await self.counters.drop([rid for rid, age in ages.items() if age > stale_after])
        in_flight: dict[str, int] = {}
        for items in (await self.counters.outstanding()).values():
            for key, amount in items:
                in_flight[key] = in_flight.get(key, 0) + amount
        today = datetime.now(UTC).date()
        tenant_ids = await anyio.to_thread.run_sync(self._tenant_ids)
        n = 0
        for tid in tenant_ids:
            for period in ("daily", "monthly"):
                window, first, last = period_window(period, today)
                money, tokens = await anyio.to_thread.run_sync(self._sql_totals, tid, first, last)
                ttl = DAY_TTL if period == "daily" else MONTH_TTL
                for unit, value in (("money", to_units(money)), ("tokens", tokens)):
                    key = self.spend_key(tid, period, window, unit)
                    await self.counters.put(key, value + in_flight.get(key, 0), ttl)
                    n += 1
        return n

    async def _seed(self, keys: list[str], tenant_id: int, today: date) -> None:
        for key in keys:
            _, _, tid, period, _, unit = key.rsplit(":", 5)
            _, first, last = period_window(period, today)
            money, tokens = await anyio.to_thread.run_sync(self._sql_totals, int(tid), first, last)
            value = to_units(money) if unit == "money" else tokens
            await self.counters.seed(key, value, DAY_TTL if period == "daily" else MONTH_TTL)

    def _sql_totals(self, tenant_id: int, first: date, last: date) -> tuple[Decimal, int]:
        with self.db.session() as s:
            money, tokens = s.execute(
                select(
                    func.coalesce(func.sum(UsageDaily.cost), 0),
                    func.coalesce(func.sum(UsageDaily.prompt_tokens + UsageDaily.completion_tokens), 0),
                ).where(UsageDaily.tenant_id == tenant_id, UsageDaily.day >= first, UsageDaily.day <= last)
            ).one()
        return Decimal(money), int(tokens)

    def _tenant_ids(self) -> list[int]:
        with self.db.session() as s:
            return list(s.scalars(select(UsageDaily.tenant_id).distinct()))


def _refusal(item: Item, current: int, budgets: dict[str, Budget], now: float) -> APIError:
    parts = item.key.rsplit(":", 5)  # namespace, "rate"|"spend", scope|tenant, id|period, minute|window, unit
    if parts[1] == "rate":
        retry = max(1, math.ceil(60 - now % 60))
        what = "requests" if parts[-1] == "requests" else "tokens"
        return APIError(
            429,
            f"Rate limit reached for this {parts[2]}: {item.limit} {what} per minute. Retry in {retry} s.",
            code="rate_limit_exceeded",
            type="rate_limit_error",
            headers={"retry-after": str(retry)},
        )
    period, unit = parts[3], parts[-1]
    if unit == "money":
        limit, used, ask = from_units(item.limit or 0), from_units(current), from_units(item.amount)
        detail = f"${limit.normalize():f}; ${used.quantize(Decimal('0.000001'))} is spent or reserved"
        detail += f" and this request could cost up to ${ask.quantize(Decimal('0.000001'))}"
    else:
        detail = f"{item.limit} tokens; {current} are used or reserved and this request could use {item.amount}"
    return APIError(
        429,
        f"The tenant's {period} budget of {detail}. Lower max_tokens or wait for the next period.",
        code="insufficient_quota",
        type="insufficient_quota",
    )
