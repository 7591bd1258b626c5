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

When the counters cannot be reached, tenants with a hard budget or a rate limit get a 503 and the
others are served uncounted. Once they answer again, settlements that failed meanwhile are retried
and the counters are rebuilt from SQL; so is every counter a settlement finds no longer holding its
reservation (a Redis that restarted empty). A rebuild is exact under load: each tenant's counters are
rewritten only if no reservation or settlement of that tenant happened between reading SQL and
writing them (else it reads again).
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
from sqlalchemy.orm import Session

from core.db.database import UNREACHABLE, Database
from core.db.models import Usage, UsageDaily
from core.money import from_units, to_units
from policies.counters import Counters, Item, Missing
from policies.policy import Budget, Policy

log = logging.getLogger(__name__)


class BudgetError(Exception):
    """A request the tenant's budgets or rate limits refuse; the gateway maps each kind to its HTTP answer."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BudgetExceeded(BudgetError):
    """A spend or token budget for the period would be passed by this request's worst case."""


class RateLimited(BudgetError):
    """A per-key or per-tenant requests/tokens-per-minute limit is reached; retry after `retry_after` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CountersUnavailable(BudgetError):
    """The counters cannot be reached and the policy has limits to enforce: fail closed, retry shortly."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("Budgets cannot be checked right now; retry shortly.")
        self.retry_after = retry_after


DAY_TTL = 3 * 86400
MONTH_TTL = 33 * 86400
MINUTE_TTL = 120


@dataclass(frozen=True)
class Reservation:
    resv_id: str
    items: list[Item]  # empty: admitted uncounted while the counters were down
    money_units: int  # the worst-case cost reserved
    tokens: int  # the worst-case tokens reserved
    version: str | None = None  # the tenant's version counter, bumped when this settles


def period_window(period: str, day: date) -> tuple[str, date, date]:
    """(window name, first day, last day) of the budget period containing `day` (UTC)."""
    if period == "daily":
        return day.isoformat(), day, day
    first = day.replace(day=1)
    nxt = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return first.strftime("%Y-%m"), first, date.fromordinal(nxt.toordinal() - 1)


class Budgets:
    RETRY_AFTER = 1.0  # seconds without trying the counters after they failed
    REBUILD_TRIES = 50  # reads of SQL per tenant before a rebuild gives up (the next repair tries again)
    MAX_UNSETTLED = 10_000  # settlements kept to retry after an outage; past that, the rebuild covers them

    def __init__(self, db: Database, counters: Counters, namespace: str = "sb") -> None:
        self.db = db
        self.counters = counters
        self.ns = namespace
        self._down_until = 0.0  # while the counters are known down, don't make each request wait on them
        self._missed = False  # the counters missed something: rebuild them from SQL once they answer
        self._unsettled: dict[str, tuple[Reservation, Decimal, int]] = {}  # failed settlements, to retry
        self._repair: asyncio.Task | None = None

    def spend_key(self, tenant_id: int, period: str, window: str, unit: str) -> str:
        return f"{self.ns}:spend:{tenant_id}:{period}:{window}:{unit}"

    @property
    def rebuilding(self) -> bool:
        """A rebuild of the counters from SQL is running in the background (after an outage)."""
        return self._repair is not None

    @property
    def backing_off(self) -> bool:
        """The counters failed within the last RETRY_AFTER seconds: limited requests are refused (503) meanwhile."""
        return time.monotonic() < self._down_until

    def version_key(self, tenant_id: int) -> str:
        """Bumped by every reservation and settlement of the tenant: a rebuild's check that none raced it."""
        return f"{self.ns}:spend:{tenant_id}:version"

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
        version = self.version_key(tenant_id)
        backing_off = self.backing_off
        try:
            if backing_off:
                raise RedisError("budget counters are down (backing off)")
            for _ in range(3):
                try:  # the version item: a reservation bumps it, so a concurrent rebuild reads SQL again
                    refused = await self.counters.reserve(resv_id, [*items, Item(version, 1, None, MONTH_TTL)])
                    break
                except Missing as missing:
                    await self._seed(missing.keys, tenant_id, today)
            else:
                raise RuntimeError("budget counters could not be seeded")
        except (RedisError, OSError, RuntimeError, *UNREACHABLE) as exc:
            if isinstance(exc, UNREACHABLE):  # SQL could not seed a counter: Redis itself is fine
                log.warning("budget counters cannot be seeded: the database is unreachable (%s)", type(exc).__name__)
            elif not backing_off:  # only a real attempt restarts the wait: steady traffic must not defer it forever
                log.warning("budget counters unavailable (%s); retrying in %.0f s", exc, self.RETRY_AFTER)
                self._down_until = time.monotonic() + self.RETRY_AFTER
            if any(it.limit is not None for it in items):  # fail closed: a hard budget or a limit is a promise
                raise CountersUnavailable(retry_after=1) from exc
            self._missed = True  # nothing to enforce: serve it; the ledger still records it
            return Reservation(resv_id, [], 0, 0, version)
        self._repair_if_missed()
        if refused is not None:
            raise _refusal(items[refused.index], refused.current, budgets, now)
        return Reservation(resv_id, items, money, worst_tokens, version)

    async def settle(self, resv: Reservation, cost: Decimal, tokens: int) -> None:
        """Replace the reservation by what was spent. Never raises: the ledger row is already written,
        and if the counters cannot be reached, the settlement is retried and the counters rebuilt from
        SQL once they answer again."""
        try:
            held = await self._settle(resv, cost, tokens)
        except (RedisError, OSError) as exc:
            log.warning("could not settle reservation %s (%s); retrying once the counters answer", resv.resv_id, exc)
            if len(self._unsettled) < self.MAX_UNSETTLED:
                self._unsettled[resv.resv_id] = (resv, cost, tokens)
            self._missed = True
            return
        if not held:  # uncounted, or its reservation was lost (Redis restarted empty): count it from SQL
            self._missed = True
        self._repair_if_missed()

    async def _settle(self, resv: Reservation, cost: Decimal, tokens: int) -> bool:
        """Settle on the counters; True if the reservation was still held there."""
        money = to_units(cost)
        deltas = []
        for it in resv.items:
            if it.key.endswith(":money"):
                deltas.append((it.key, money - resv.money_units))
            elif it.key.endswith(":tokens"):
                deltas.append((it.key, tokens - resv.tokens))
            else:
                deltas.append((it.key, 0))
        if not deltas and resv.version is None:
            return True  # nothing was counted and no rebuild can be told: settled as far as it can be
        return await self.counters.settle(resv.resv_id, deltas, resv.version, MONTH_TTL)

    def _repair_if_missed(self) -> None:
        """The counters answer: if they missed something, rebuild them in the background."""
        if self._missed and self._repair is None:
            self._repair = asyncio.get_running_loop().create_task(self._repair_counters())

    async def _repair_counters(self) -> None:
        try:
            while self._missed:  # whatever is missed while a rebuild runs gets one more
                self._missed = False
                while self._unsettled:  # each applied only if Redis still holds its reservation
                    rid, (resv, cost, tokens) = next(iter(self._unsettled.items()))
                    await self._settle(resv, cost, tokens)
                    del self._unsettled[rid]
                log.info("budget counters are back: rebuilt %d from the ledger", await self.reconcile())
        except Exception:  # the next request that reaches the counters tries again
            log.exception("rebuilding the budget counters after an outage failed")
            self._missed = True
        finally:
            self._repair = None

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
        today = datetime.now(UTC).date()
        n = 0
        for tid in await anyio.to_thread.run_sync(self._tenant_ids):
            n += await self._rebuild(tid, today)
        return n

    async def _rebuild(self, tenant_id: int, today: date) -> int:
        """One tenant's spend counters as SQL's settled total plus what its held reservations reserved.

        A request's ledger row commits before it settles, so a row can be in SQL while its reservation
        is still held: such rows count as their reservation, not twice. The counters are written only
        if the tenant's version counter did not move meanwhile (no reservation or settlement raced the
        read); otherwise SQL is read again."""
        windows = {period: period_window(period, today) for period in ("daily", "monthly")}
        counters = {
            self.spend_key(tenant_id, period, window, unit): (period, unit)
            for period, (window, _, _) in windows.items()
            for unit in ("money", "tokens")
        }
        version = self.version_key(tenant_id)
        for _ in range(self.REBUILD_TRIES):
            seen = await self.counters.get(version)  # first: a reservation after this read moves it
            held: dict[str, int] = {}
            holders: set[str] = set()
            for rid, items in (await self.counters.outstanding()).items():
                for key, amount in items:
                    if key in counters:
                        held[key] = held.get(key, 0) + amount
                        holders.add(rid)
            settled = await anyio.to_thread.run_sync(self._settled_totals, tenant_id, windows, holders)
            values = {}
            for key, (period, unit) in counters.items():
                money, tokens = settled[period]
                value = to_units(money) if unit == "money" else tokens
                values[key] = (value + held.get(key, 0), DAY_TTL if period == "daily" else MONTH_TTL)
            if await self.counters.rebuild(version, seen, values):
                return len(values)
        raise RuntimeError(f"tenant {tenant_id}'s counters kept changing while they were rebuilt")

    def _settled_totals(
        self, tenant_id: int, windows: dict[str, tuple[str, date, date]], holders: set[str]
    ) -> dict[str, tuple[Decimal, int]]:
        """Per period, the tenant's ledger totals without the rows of reservations still held, read
        in one snapshot so that no row commits between the totals and the rows taken out of them."""
        out: dict[str, tuple[Decimal, int]] = {}
        with self.db.snapshot() as s:
            held_rows = []
            if holders:
                held_rows = s.execute(
                    select(Usage.created_at, Usage.cost, Usage.prompt_tokens + Usage.completion_tokens).where(
                        Usage.tenant_id == tenant_id, Usage.request_id.in_(holders)
                    )
                ).all()
            for period, (_, first, last) in windows.items():
                money, tokens = _totals(s, tenant_id, first, last)
                for created, cost, used in held_rows:
                    if first <= _utc_day(created) <= last:  # the rollup's day: UTC
                        money, tokens = money - Decimal(cost), tokens - int(used)
                out[period] = (money, tokens)
        return out

    async def _seed(self, keys: list[str], tenant_id: int, today: date) -> None:
        for key in keys:
            _, _, tid, period, _, unit = key.rsplit(":", 5)
            _, first, last = period_window(period, today)
            money, tokens = await anyio.to_thread.run_sync(self._sql_totals, int(tid), first, last)
            value = to_units(money) if unit == "money" else tokens
            await self.counters.seed(key, value, DAY_TTL if period == "daily" else MONTH_TTL)

    def _sql_totals(self, tenant_id: int, first: date, last: date) -> tuple[Decimal, int]:
        with self.db.session() as s:
            return _totals(s, tenant_id, first, last)

    def _tenant_ids(self) -> list[int]:
        with self.db.session() as s:
            return list(s.scalars(select(UsageDaily.tenant_id).distinct()))


def _totals(s: Session, tenant_id: int, first: date, last: date) -> tuple[Decimal, int]:
    """The tenant's money and tokens from the daily rollup, `first` to `last` inclusive."""
    money, tokens = s.execute(
        select(
            func.coalesce(func.sum(UsageDaily.cost), 0),
            func.coalesce(func.sum(UsageDaily.prompt_tokens + UsageDaily.completion_tokens), 0),
        ).where(UsageDaily.tenant_id == tenant_id, UsageDaily.day >= first, UsageDaily.day <= last)
    ).one()
    return Decimal(money), int(tokens)


def _utc_day(at: datetime) -> date:
    """The UTC day of a stored timestamp (SQLite hands them back without a zone: they are UTC)."""
    return (at if at.tzinfo is None else at.astimezone(UTC)).date()


def _refusal(item: Item, current: int, budgets: dict[str, Budget], now: float) -> BudgetError:
    parts = item.key.rsplit(":", 5)  # namespace, "rate"|"spend", scope|tenant, id|period, minute|window, unit
    if parts[1] == "rate":
        retry = max(1, math.ceil(60 - now % 60))
        what = "requests" if parts[-1] == "requests" else "tokens"
        return RateLimited(
            f"Rate limit reached for this {parts[2]}: {item.limit} {what} per minute. Retry in {retry} s.", retry
        )
    period, unit = parts[3], parts[-1]
    if unit == "money":
        limit, used, ask = from_units(item.limit or 0), from_units(current), from_units(item.amount)
        detail = f"${limit.normalize():f}; ${used.quantize(Decimal('0.000001'))} is spent or reserved"
        detail += f" and this request could cost up to ${ask.quantize(Decimal('0.000001'))}"
    else:
        detail = f"{item.limit} tokens; {current} are used or reserved and this request could use {item.amount}"
    return BudgetExceeded(f"The tenant's {period} budget of {detail}. Lower max_tokens or wait for the next period.")
