"""The SQL schema. Alembic migrations in `core/migrations/` create it; these classes must match them."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    Numeric,
    String,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator, TypeEngine

from core.money import UNITS


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """A timestamp read back from the database, zone-aware: SQLite hands back naive UTC times."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # The operator's tenant: its admin and finance keys see every tenant; other tenants' see their own.
    is_operator: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)  # shown in lists; finds the row
    key_hash: Mapped[str] = mapped_column(String(64))  # HMAC-SHA256 hex of the key (server secret)
    role: Mapped[str] = mapped_column(String(16), default="app")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class MoneyType(TypeDecorator):
    """Dollars as `Decimal`, exact: NUMERIC(24, 10) on PostgreSQL; on SQLite, which has no decimal
    type (it would keep floats), an integer count of 1e-10 dollars, so sums stay exact there too.
    10 places hold any per-token price given to 4 places per million tokens."""

    impl = Numeric(24, 10)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(BigInteger())
        return dialect.type_descriptor(Numeric(24, 10, asdecimal=True))

    def process_bind_param(self, value: Decimal | int | None, dialect: Dialect) -> Decimal | int | None:
        if value is None or dialect.name != "sqlite":
            return value
        units = Decimal(value) * UNITS
        if units != units.to_integral_value():
            raise ValueError(f"{value} has more than 10 decimal places")
        return int(units)

    def process_result_value(self, value: object, dialect: Dialect) -> Decimal | None:
        if value is None:
            return None
        if dialect.name == "sqlite":
            return Decimal(int(value)) / UNITS  # type: ignore[call-overload]
        return Decimal(value)  # type: ignore[arg-type]


Money = MoneyType()


class Usage(Base):
    """The ledger: one row per request that ran; the request id as primary key makes a second impossible."""

    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_tenant_created", "tenant_id", "created_at"),)

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(100))  # the checkpoint that served it
    tier: Mapped[str] = mapped_column(String(32))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    draft_proposed: Mapped[int] = mapped_column(Integer, default=0)
    draft_accepted: Mapped[int] = mapped_column(Integer, default=0)
    requested_max_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    effective_max_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cache_status: Mapped[str] = mapped_column(String(16), default="miss")  # hit | semantic-hit | miss | bypass
    route: Mapped[str] = mapped_column(String(32), default="direct")  # direct: the request named its tier
    verifier_actions: Mapped[list] = mapped_column(JSON, default=list)
    policy_version: Mapped[int] = mapped_column(Integer, default=0)  # 0: the built-in default policy
    cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    counterfactual_cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))  # always the large tier
    saved_cache: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))  # the saving, split by lever
    saved_routing: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_speculation: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_verifier: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_policy: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    latency_ms: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))  # ok | aborted | error
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # the model name the client sent, where it was not the tier's (an alias, or `auto`)
    requested_model: Mapped[str | None] = mapped_column(String(100), nullable=True)


class UsageDaily(Base):
    """Per tenant, UTC day, tier and model: the ledger's sums, kept up to date in the same transaction
    as each usage row, so reports and budgets never scan raw rows."""

    __tablename__ = "usage_daily"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    tier: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(String(100), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_proposed: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_accepted: Mapped[int] = mapped_column(BigInteger, default=0)
    cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    counterfactual_cost: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_cache: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_routing: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_speculation: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_verifier: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))
    saved_policy: Mapped[Decimal] = mapped_column(Money, default=Decimal(0))


class PolicyVersion(Base):
    """Every version of every tenant's policy; the highest version is in force. Never updated."""

    __tablename__ = "policy_versions"
    __table_args__ = (UniqueConstraint("tenant_id", "version", name="uq_policy_versions_tenant_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict] = mapped_column(JSON)
    note: Mapped[str] = mapped_column(String(200), default="")
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AuditEntry(Base):
    """Who changed what, when, and the before and after."""

    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True)
    actor: Mapped[str] = mapped_column(String(64))  # the acting key's prefix and role, or "cli"
    action: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(200))
    before: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    after: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RoutedPrompt(Base):
    """Conversations the router decided on, kept only for tenants whose policy says `router.store_prompts`:
    what `switchboard router calibrate --tenant` computes that tenant's threshold on."""

    __tablename__ = "routed_prompts"
    __table_args__ = (Index("ix_routed_prompts_tenant_id", "tenant_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    request_id: Mapped[str] = mapped_column(String(64))
    messages: Mapped[list] = mapped_column(JSON)
    p_small_ok: Mapped[float] = mapped_column(Float)
    tier: Mapped[str] = mapped_column(String(32))  # where the router sent it
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class PolicyProposal(Base):
    """A policy `switchboard policy tune` proposed for a tenant, with its evidence (the report's table and
    plot); an admin applies it (a new policy version) or rejects it."""

    __tablename__ = "policy_proposals"
    __table_args__ = (Index("ix_policy_proposals_tenant_id", "tenant_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    base_version: Mapped[int] = mapped_column(Integer)  # the policy version it was tuned from
    status: Mapped[str] = mapped_column(String(16))  # proposed | unchanged | applied | rejected
    policy: Mapped[dict] = mapped_column(JSON)  # the whole proposed policy
    report: Mapped[dict] = mapped_column(JSON)  # every candidate's tokens, cost, quality and interval
    plot: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # PNG: cost against quality
    created_by: Mapped[str] = mapped_column(String(64))  # "cli", "schedule" or an admin key
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    decided_by: Mapped[str | None] = mapped_column(String(64), nullable=True)
    decided_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    applied_version: Mapped[int | None] = mapped_column(Integer, nullable=True)


class StoredResponse(Base):
    """A Responses API response kept for its tenant (`store: true`): `previous_response_id` continues from its
    `context` (every item before it, its input and its output, in order), GET returns `response`. Rows past
    `expires_at` are never served and are deleted as new ones are written."""

    __tablename__ = "stored_responses"
    __table_args__ = (Index("ix_stored_responses_expires_at", "expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the response's id, the ledger's request id
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    response: Mapped[dict] = mapped_column(JSON)  # the response object as it was answered
    input_items: Mapped[list] = mapped_column(JSON)  # this turn's input items, with their ids
    context: Mapped[list] = mapped_column(JSON)  # what a continuation is prepended with
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Adapter(Base):
    """A LoRA adapter a tenant may run on one of its tiers (`model: "small:NAME"`, or its policy's default): the
    PEFT files under `path` (the tenant's own folder in the gateway's home), their digest, and who put it there.
    Registered by an admin (uploaded) or by `switchboard distill`; a tenant's rows serve that tenant only."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "tier", "name", name="uq_adapters_tenant_tier_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    tier: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))  # sha256 of its config and weights (`engines.lora`)
    path: Mapped[str] = mapped_column(String(500))
    rank: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # the two files on disk
    source: Mapped[str] = mapped_column(String(16))  # uploaded | distilled
    details: Mapped[dict] = mapped_column(JSON, default=dict)  # distill: examples, held-out agreement, seconds
    created_by: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
