"""`bench.soak`'s report: the table of samples, the PNG of them over time, the answers by kind and verdict,
the policy and outage checks, and the gateway log's summary."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

from bench.load import say
from bench.soak_traffic import POLICY_CAP, Soak
from bench.soak_verdict import Sample, judge

__all__ = ["fmt", "log_summary", "outage_check", "plot", "policy_check", "rates", "report_calls", "table"]


def fmt(v: float | int | None) -> str:
    return "-" if v is None else f"{v}"


def table(samples: list[Sample], base: Sample, end: Sample) -> None:
    print("\n| t (min) | phase | RSS MB | fds | gateway CPU % | PG conns | KV used | KV cached | running | Redis keys "
          "| requests | unexpected 5xx |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in samples:
        mark = " (warm)" if s is base else " (end)" if s is end else ""
        print(f"| {s.t / 60:.1f} | {s.phase}{mark} | {s.rss_mb:.1f} | {s.fds} | {s.cpu_pct:.0f} | {fmt(s.pg_conns)} "
              f"| {fmt(s.kv_used)} | {fmt(s.kv_cached)} | {fmt(s.running)} | {fmt(s.redis_keys)} | {s.requests} "
              f"| {s.bad_5xx} |")  # fmt: skip


def plot(samples: list[Sample], soak: Soak, warmup_s: float, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        say("matplotlib is not installed: no plot")
        return
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    t = [s.t / 60 for s in samples]
    panels: list[tuple[str, list[tuple[str, list[float | None]]]]] = [
        ("gateway RSS (MB)", [("RSS", [s.rss_mb for s in samples])]),
        ("open file descriptors", [("fds", [float(s.fds) for s in samples])]),
        ("PostgreSQL connections", [("soak database", [s.pg_conns for s in samples])]),
        ("KV blocks", [("in use", [s.kv_used for s in samples]), ("cached", [s.kv_cached for s in samples])]),
        ("Redis keys (DBSIZE)", [("keys", [s.redis_keys for s in samples])]),
        ("requests answered per second", [("all", rates(samples))]),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(11, 9), sharex=True)
    for ax, (title, lines) in zip(axes.flat, panels, strict=True):
        for label, ys in lines:
            pts = [(x, y) for x, y in zip(t, ys, strict=True) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.set_title(title, fontsize=10)
        ax.axvline(warmup_s / 60, color="grey", linestyle=":", linewidth=1)
        if soak.policy_at is not None:
            ax.axvline(soak.policy_at / 60, color="green", linestyle="--", linewidth=1)
        if soak.outage is not None:
            ax.axvspan(soak.outage.start / 60, soak.outage.end / 60, color="red", alpha=0.2)
        ax.axvline(soak.duration / 60, color="black", linestyle="--", linewidth=1)
        if len(lines) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle("bench.soak: grey dotted = end of warm-up, green = policy change, red = Redis down, black = load end",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    say(f"plot: {path}")


def rates(samples: list[Sample]) -> list[float | None]:
    out: list[float | None] = [None]
    for a, b in itertools.pairwise(samples):
        out.append((b.requests - a.requests) / (b.t - a.t) if b.t > a.t and b.phase != "idle-after" else None)
    return out


def report_calls(soak: Soak) -> None:
    outcomes: dict[str, Counter[str]] = {}
    for c in soak.calls:
        kind = "bad" if c.kind.startswith("bad:") else c.kind
        key = f"{c.status} {c.code}".strip() if c.status != 200 else "200"
        outcomes.setdefault(kind, Counter())[f"{key} [{judge(c, soak.outage)}]"] += 1
    print("\n| kind | requests | answers [verdict] |")
    print("|---|---:|---|")
    for kind, counts in sorted(outcomes.items()):
        shown = ", ".join(f"{k}: {n}" for k, n in counts.most_common())
        print(f"| {kind} | {sum(counts.values())} | {shown} |")
    odd = [c for c in soak.calls if judge(c, soak.outage) not in ("ok", "outage")]
    for c in odd[:10]:
        say(f"  odd: {c.kind} {c.tenant} at {c.t0:.1f}s: HTTP {c.status} {c.code} {c.stream_error} {c.note}")
    hits = sum(1 for c in soak.calls if c.kind == "hit" and c.cache == "hit")
    n_hits = sum(1 for c in soak.calls if c.kind == "hit" and c.status == 200)
    cancelled = [c for c in soak.calls if c.kind == "cancel" and c.status == 200]
    closed = sum(1 for c in cancelled if c.note == "closed")
    print(f"\ncache hits: {hits} of {n_hits} repeat-prompt answers; cancelled streams: {closed} closed mid-way "
          f"(+{len(cancelled) - closed} that finished first)")  # fmt: skip


def policy_check(soak: Soak) -> int:
    """soak-main answers started a second after the policy change that ran past its cap."""
    if soak.policy_at is None:
        return 0
    after = [c for c in soak.calls if c.tenant == "soak-main" and c.status == 200 and c.t0 >= soak.policy_at + 1]
    counted = [c for c in after if c.completion_tokens is not None]
    over = [c for c in counted if c.completion_tokens is not None and c.completion_tokens > POLICY_CAP]
    print(f"policy change at {soak.policy_at:.0f}s (version {soak.policy_version}): {len(counted)} later soak-main "
          f"answers with usage, {len(over)} over max_tokens_cap {POLICY_CAP}")  # fmt: skip
    return len(over)


def outage_check(soak: Soak) -> None:
    w = soak.outage
    if w is None:
        print("no Redis outage (the run was too short)")
        return
    refused = [c for c in soak.calls if judge(c, w) == "outage"]
    last = max((c.t1 for c in refused), default=None)
    back = min((c.t1 for c in soak.calls if c.tenant == "soak-main" and c.status == 200 and c.t0 > w.end),
               default=None)  # fmt: skip
    open_ok = sum(1 for c in soak.calls if c.tenant == "soak-open" and w.start <= c.t0 <= w.end and c.status == 200)
    print(f"Redis down {w.start:.0f}s to {w.end:.0f}s: {len(refused)} 503 budget_unavailable to tenants with limits"
          + (f", the last {last - w.end:+.1f}s after the restart" if last is not None else "")
          + (f"; soak-main served again {back - w.end:.1f}s after it" if back is not None else "")
          + f"; soak-open served {open_ok} during it")  # fmt: skip


def log_summary(log: Path) -> str:
    """The gateway log's lines by level (it logs warnings and up here), and its tracebacks."""
    levels: Counter[str] = Counter()
    tracebacks = 0
    for line in log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            levels["other"] += 1
            continue
        levels[str(record.get("level", "other")).lower()] += 1
        tracebacks += "exc" in record
    shown = ", ".join(f"{n} {level}" for level, n in levels.most_common()) or "empty"
    return f"gateway log: {shown}; {tracebacks} with a traceback"
