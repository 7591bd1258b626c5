"""Agent tool loops on `model: "auto"`, with the tier lock and without: tier switches inside a loop, and the prompt
tokens the prefix cache served per turn.

    OMP_NUM_THREADS=2 .venv/bin/python -m bench.tool_loops [--loops 20] [--seed 0]

A gateway (`switchboard serve`, SQLite) whose `small` and `large` tiers are two SmolLM2-135M engines, each with its
own KV cache (so a switch loses the loop's prefix, as between real tiers), routed by a router trained on synthetic
labels (`router_model.synthetic`: short chat passes on small, long many-step arithmetic does not). Each loop is an
OpenAI Agents SDK agent on its default settings (the Responses API) with one function tool it must call every turn
(`tool_choice="required"`, not reset), run for 3-6 turns (`max_turns`; the SDK's MaxTurnsExceeded ends it), whose
results alternate a short sentence and a long many-step word problem: asked afresh, the router sends such a turn
large. The same loops run for two tenants, `router.lock_tool_loops` on and off. From the ledger, per loop in
order: each turn's tier and cached prompt tokens. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import tempfile
import uuid
from pathlib import Path
from typing import Annotated, Any

import httpx
import sqlalchemy as sa
from pydantic import Field

from bench.serve import ROOT, SERVE, launch_serve, say, serve_env

QUESTIONS = ["Hi! How are you today?", "What is the weather in Oslo?", "Say hello to Maria.", "Is it sunny in Rome?"]
HARD = (
    "Result: Fatima has 312 marbles. Then Fatima sells 45 marbles. Then Fatima buys 17 marbles. Then Fatima trades "
    "62 marbles. Then Fatima loses 33 marbles. Then Fatima finds 9 marbles. Each week this repeats 7 times and 25% "
    "are lost. How many marbles does Fatima have at the end? Solve it step by step."
)
# Two configurations, so two engines (tiers naming one configuration share its engine and its KV cache).
TIERS = {"small": {"model": "smollm2-135m-instruct"}, "large": {"model": "smollm2-135m-instruct", "max_num_seqs": 32}}


def train(router_dir: Path) -> None:
    from router_model.encoder import RouterEncoder
    from router_model.examples import split_examples
    from router_model.model import save_router
    from router_model.synthetic import synthetic_examples
    from router_model.train import train_router

    train_set, heldout = split_examples(synthetic_examples(200, seed=1), test_size=0.25, seed=0)
    result = train_router(train_set, heldout, RouterEncoder(), seed=0, folds=2, candidates=("hist_gb",),
                          large_share=0.4)  # fmt: skip
    save_router(result.router, router_dir)


def tenant(home: Path, db_url: str, url: str, lock: bool) -> tuple[str, int]:
    """A tenant routing by the router's calibrated threshold, the lock on or off: its admin key and id."""
    from core.db.database import Database
    from gateway.accounting.tenants import create_tenant, tenant_by_name, use_key_secret

    use_key_secret(None, home)  # the server's: keys are stored as HMACs under its home's secret

    name = f"loops-{'lock' if lock else 'fresh'}-{uuid.uuid4().hex[:6]}"
    db = Database(db_url)
    key = create_tenant(db, name, role="admin").key
    found = tenant_by_name(db, name)
    assert found is not None
    db.dispose()
    policy = {"router": {"mode": "large_share", "shadow_share": 0.0, "lock_tool_loops": lock}}
    r = httpx.put(f"{url}/v1/admin/tenants/{name}/policy", json=policy, headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return key, found.id


async def run_loop(url: str, key: str, question: str, turns: int) -> None:
    """One agent loop: the tool called every turn, until `turns` model calls (or a turn cut short by its token
    limit, which the SDK ends the run on) end it."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)
    calls = 0

    @agents.function_tool
    def lookup(query: Annotated[str, Field(max_length=40)]) -> str:  # bounded: a call always fits its turn
        """Look something up."""
        nonlocal calls
        calls += 1
        return HARD if calls % 2 else "It is sunny and 21 C."

    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0)
    agent = agents.Agent(name="loop", instructions="Use the lookup tool.", tools=[lookup], reset_tool_choice=False,
                         model=agents.OpenAIResponsesModel(model="auto", openai_client=client),
                         model_settings=settings)  # fmt: skip
    try:
        await agents.Runner.run(agent, question, max_turns=turns)
    except agents.exceptions.MaxTurnsExceeded:
        pass
    except agents.exceptions.ModelBehaviorError as exc:  # a turn the model's token limit cut: the loop ends there
        say(f"  ended early: {str(exc)[:200]}")
    finally:
        await client.close()  # on this loop's event loop (each loop runs in its own)


def ledger(db_url: str, tenant_id: int) -> list[tuple[str, int, int]]:
    from core.db.database import Database
    from core.db.models import Usage

    db = Database(db_url)
    with db.session() as s:
        rows = s.execute(sa.select(Usage.tier, Usage.cached_prompt_tokens, Usage.prompt_tokens)
                         .where(Usage.tenant_id == tenant_id).order_by(Usage.created_at)).all()  # fmt: skip
    db.dispose()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def summary(loops: list[list[tuple[str, int, int]]]) -> dict[str, Any]:
    """Each loop's turns in order (tier, cached prompt tokens, prompt tokens) → switches and the prefix served."""
    switches = [sum(a[0] != b[0] for a, b in itertools.pairwise(loop)) for loop in loops]
    rows = [r for loop in loops for r in loop]
    later = [r for loop in loops for r in loop[1:]]  # the turns a loop's prefix could serve
    return {
        "turns": len(rows),
        "switches_inside_loops": sum(switches),
        "loops_that_switched": sum(s > 0 for s in switches),
        "large_share": round(sum(r[0] == "large" for r in rows) / max(1, len(rows)), 3),
        "cached_tokens_per_later_turn": round(statistics.mean(r[1] for r in later), 1) if later else 0,
        "cached_share_of_later_prompts": round(sum(r[1] for r in later) / max(1, sum(r[2] for r in later)), 3),
        "tiers": ["".join(r[0][0] for r in loop) for loop in loops],  # s and l per turn
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tool_loops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=20, help="agent loops per arm")
    parser.add_argument("--seed", type=int, default=0, help="picks each loop's question and turns (3-6)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    plan = [(rng.choice(QUESTIONS), rng.randint(3, 6)) for _ in range(args.loops)]
    with tempfile.TemporaryDirectory(prefix="sb-loops-") as tmp:
        home = Path(tmp)
        say("training the router on synthetic labels")
        train(home / "router")
        db_url, port = f"sqlite:///{home / 'db.sqlite'}", 8731
        env = serve_env(home, db_url, port, SWITCHBOARD_TIERS=json.dumps(TIERS), SWITCHBOARD_SHADOW_RUNS="false",
                        SWITCHBOARD_ROUTER_AUTO_TRAIN="false")  # fmt: skip
        _, url, stop = launch_serve(SERVE, env, str(ROOT), port, home / "serve.log", [])
        try:
            out: dict[str, Any] = {"loops": args.loops, "turns_planned": sum(t for _, t in plan)}
            for lock in (True, False):
                loops = []
                for n, (question, turns) in enumerate(plan):  # a tenant per loop: its ledger rows are the loop
                    key, tenant_id = tenant(home, db_url, url, lock)
                    asyncio.run(run_loop(url, key, question, turns))
                    loops.append(ledger(db_url, tenant_id))
                    say(f"{'lock' if lock else 'fresh'} loop {n + 1}/{len(plan)}: {len(loops[-1])} turns")
                out["lock" if lock else "fresh"] = summary(loops)
        finally:
            stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
