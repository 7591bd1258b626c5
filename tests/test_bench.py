"""Every benchmark imports, and runs as `python -m bench.X` from the repository root: its smallest
configuration where that takes seconds, else `--help` (the module-level code and the argument parser).

The tests are parametrized by the files in bench/, so a new benchmark is covered without an edit here (by
`--help` until it gets an entry in SMALL). The checks are on what a run prints (its last line is one JSON
object), never on its timings. The benchmarks that only answer `--help` here have their reason in HELP_ONLY;
the measuring loops and pure helpers of some are exercised in-process at the end, on a tiny random model.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
RUNNABLE = [n for n in BENCHES if 'if __name__ == "__main__":' in (ROOT / "bench" / f"{n}.py").read_text()]

# Benchmarks with no configuration that runs in seconds (measured on a 2-vCPU box): `--help` only.
HELP_ONLY = {
    "checks": "needs a label file with answer texts; its math checks load the small tier and ask it",
    "cache": "its KV-tier part times eight prefills of a ~1,000-token prompt (no flag): ~17 s at the smallest trace",
    "engine_throughput": "its shared-prefix TTFT runs ten ~1,000-token prefills (no flag): ~17 s at the smallest",
    "kv_tier": "runs every model of CASES that is in the cache, Qwen2.5-Coder-0.5B included",
    "llamacpp_batched": "needs a GGUF file: tests/test_llamacpp_build.py decodes SmolLM2's through it",
    "llamacpp_build": "`install` builds llama.cpp (minutes) where needed: tests/test_llamacpp_build.py checks it",
    "moe": "splits Qwen2.5-Coder-1.5B into experts (minutes, once) and serves it three ways",
    "policy_tune": "loads both configured tiers (Qwen2.5-Coder 0.5B and 1.5B) and tunes over a candidate grid",
    "quant": "loads bf16, int8 and int4 engines and runs perplexity on each: tens of seconds at the smallest",
    "savings": "a gateway, two SmolLM2 tiers and a router trained on the spot: tests/test_bench_savings.py runs it",
    "soak": "minutes of mixed load on a live gateway by design; how it judges what it saw is tested below",
    "spec_decode": "serves Qwen2.5-Coder-1.5B int8 with 0.5B drafts: tens of seconds at the smallest",
    "verifiers": "loads both configured tiers and answers GSM8K problems on them",
    "tools": "serves the Qwen pair and runs transformers on BFCL questions: minutes at the smallest",
}


def last_json(stdout: str, keys: set[str]) -> dict:
    result = json.loads(stdout.strip().splitlines()[-1])
    assert keys <= set(result), f"missing {keys - set(result)} in {result}"
    return result


def check_ledger(out: str) -> None:
    r = last_json(out, {"report_ms", "report_raw_ms", "overhead_p50_ms", "overhead_diff_p50_ms", "request_p50_ms"})
    assert (r["rows"], r["requests"], r["backend"]) == (200, 5, "postgresql+redis")
    assert r["rollup_check"] is True  # the daily rollup equals the raw rows' sums
    assert "rollup and raw reports agree: yes" in out
    assert r["report_month_rows"] > 0


def check_router(out: str) -> None:
    r = last_json(out, {"apgr", "cpt50", "cpt80", "apgr_random", "apgr_optimal", "route_p50_ms", "classifier"})
    assert (r["n_labeled"], r["n_train"], r["labels"]) == (60, 48, "synthetic")
    assert 0 <= r["cpt50"] <= 1 and 0 <= r["cpt80"] <= 1  # shares of calls


def check_routing(out: str) -> None:
    r = last_json(out, {"route_p50_ms", "route_p90_ms", "route_cpu_p50_ms", "burst_p50_ms", "word_pieces_p50"})
    assert (r["prompts"], r["n"], r["concurrency"], r["capped"], r["omp_threads"]) == ("synthetic", 8, 2, True, 1)


def check_decode_speed(out: str) -> None:
    r = last_json(out, {"smollm2-135m-instruct/bf16"})["smollm2-135m-instruct/bf16"]
    assert {"load_s", "tok_s", "ttft_ms"} <= set(r)
    assert (r["hf_tok_s"], r["ratio"], r["first_start_s"], r["threads"]) == (None, None, None, 1)  # --no-hf


def check_load(out: str) -> None:
    r = last_json(out, {"hit_rps", "hit_p50_ms", "hit_p99_ms", "stream_ttft_p99_ms", "stream_tokens_per_s"})
    assert r["concurrency"] == 2
    assert (r["hit_errors"], r["hit_non_hits"]) == (0, 0) and r["hit_requests"] > 0  # every timed request a hit
    assert (r["stream_errors"], r["stream_completed"]) == (0, 2)


def check_sandbox(out: str) -> None:
    r = last_json(out, {"pass_jail_p50_ms", "pass_fence_p50_ms", "small_added_p50_ms", "layers"})
    assert r["runs"] == 2 and r["layers"]["self_test"].startswith("passed") and "humaneval_solutions" not in r


def check_semantic_long(out: str) -> None:
    r = last_json(out, {"pairs", "ways", "threshold"})
    assert r["pairs"] == 12 and set(r["ways"]) == {"truncated", "windows", "differing", "exact"}
    assert r["ways"]["differing"]["a needle past the window"] == 0.0  # the rule this bench chose


def check_gpu(out: str) -> None:
    assert "no CUDA device on this machine; nothing to measure" in out


# bench → (its smallest configuration, the check of its output, the fixtures it needs); `slow`: a registry model.
SMALL: dict[str, tuple[list[str], Callable[[str], None], tuple[str, ...]]] = {
    "ledger": (["--rows", "200", "--reps", "2", "--requests", "5", "--warmup", "2"], check_ledger,
               ("postgres_server", "redis_server")),
    "router": (["--synthetic", "60", "--folds", "2", "--timing-prompts", "5"], check_router, ()),
    "routing": (["--prompts", "synthetic", "-n", "8", "--concurrency", "2"], check_routing, ()),
    "decode_speed": (["--models", "smollm2-135m-instruct", "--dtypes", "bf16", "--tokens", "4", "--runs", "1",
                      "--no-hf"], check_decode_speed, ()),
    "load": (["--mode", "both", "--concurrency", "2", "--duration", "0.5", "--max-tokens", "4"], check_load,
             ("postgres_server", "redis_server")),
    "sandbox": (["--runs", "2", "--no-humaneval"], check_sandbox, ()),
    "semantic_long": (["--per-kind", "2"], check_semantic_long, ()),
}  # fmt: skip
SLOW = {"decode_speed", "load"}
if not torch.cuda.is_available():  # without CUDA it says so and exits 0; with CUDA it loads every tier: --help
    SMALL["gpu"] = ([], check_gpu, ())


def run_bench(name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [sys.executable, "-m", f"bench.{name}", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(cmd[1:])} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done


@pytest.fixture
def bench_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], object]:
    """`bench.<name>`, imported as `python -m` from the repository root imports it."""

    def load(name: str) -> object:
        monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # or bench.common exits
        if str(ROOT) not in sys.path:
            monkeypatch.syspath_prepend(str(ROOT))
        return importlib.import_module(f"bench.{name}")

    return load


@pytest.mark.parametrize("name", BENCHES)
def test_imports(name: str, bench_module: Callable) -> None:
    module = bench_module(name)
    assert module.__doc__, f"bench/{name}.py says what it measures and how to run it"
    if hasattr(module, "main"):
        assert f"python -m bench.{name}" in module.__doc__, "its usage line runs it as a module"


@pytest.mark.parametrize("name", [n for n in RUNNABLE if n not in SMALL])
def test_help(
    name: str, bench_module: Callable, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`python -m bench.X --help`, in this process (a subprocess would import torch again): module and parser."""
    main = bench_module(name).main
    monkeypatch.setattr(sys, "argv", [f"{ROOT}/bench/{name}.py", "--help"])  # sys.argv under `python -m`
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m bench.{name} [-h]")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in SMALL])
def test_smallest_configuration(name: str, request: pytest.FixtureRequest) -> None:
    """`python -m bench.X` with its smallest settings, in a subprocess from the repository root."""
    args, check, fixtures = SMALL[name]
    urls = {f: request.getfixturevalue(f) for f in fixtures}
    env = {}
    if "postgres_server" in urls:  # the session's servers, not throwaway ones of the bench's own
        env["SWITCHBOARD_TEST_POSTGRES_URL"] = urls["postgres_server"]
    if "redis_server" in urls:
        env["SWITCHBOARD_TEST_REDIS_URL"] = urls["redis_server"]
    check(run_bench(name, args, env).stdout)


def test_every_bench_named_here_exists() -> None:
    assert set(SMALL) | set(HELP_ONLY) <= set(RUNNABLE) and not set(SMALL) & set(HELP_ONLY)


# --- in-process: the measuring loops and helpers of benches that only answer --help above ---------------


@pytest.fixture(scope="module")
def tiny_engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny import tiny_hf_model

    return tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-bench"))


def tiny_engine(model_dir: Path, **config: object) -> object:
    from engines.engine import Engine, EngineConfig

    return Engine.from_dir(model_dir, dtype="fp32", config=EngineConfig(kv_cache_bytes=1 << 22, block_size=8, **config))


def test_engine_throughput_counts_every_generated_token(tiny_engine_dir: Path, bench_module: Callable) -> None:
    et = bench_module("engine_throughput")
    jobs = [et.Job(list(range(3 + i, 10 + 2 * i)), 3 + i) for i in range(5)]  # EOS ignored: exactly max_tokens
    for concurrency in (1, 3):
        assert et.run_ours(tiny_engine(tiny_engine_dir), jobs, concurrency)["tokens"] == sum(j.max_tokens for j in jobs)
    engines = [tiny_engine(tiny_engine_dir, enable_prefix_caching=flag) for flag in (True, False)]
    steps = et.lockstep(engines, jobs, 2, lambda i: f"salt-{i}")
    assert [tokens for _, tokens in steps] == [sum(j.max_tokens for j in jobs)] * 2


def test_spec_decode_waves_keep_every_answer(tiny_engine_dir: Path, bench_module: Callable) -> None:
    sd = bench_module("spec_decode")
    engines = {"a": tiny_engine(tiny_engine_dir), "b": tiny_engine(tiny_engine_dir)}
    prompts = [list(range(5 + i, 12 + 3 * i)) for i in range(4)]
    one = sd.decode(engines, prompts, 1, 6)
    two = sd.decode(engines, prompts, 2, 6)
    assert set(one) == {"a", "b"} and all(rate > 0 for rate, _ in one.values())
    answers = one["a"][1]
    assert len(answers) == len(prompts) and all(1 <= len(o) <= 6 for o in answers)
    # Greedy: the same answers in waves of 2 as one at a time, in prompt order, whichever engine ran
    # a wave first (the order rotates by wave).
    assert one["b"][1] == two["a"][1] == two["b"][1] == answers


def test_cache_trace_near_misses_ask_something_else(bench_module: Callable) -> None:
    import random

    cache = bench_module("cache")
    rng = random.Random(0)
    assert cache.near_miss("What is 12 times 3?", rng) not in (None, "What is 12 times 3?")
    assert cache.near_miss("Why is the sky blue?", random.Random(0)) == "Why is not the sky blue?"
    assert cache.near_miss("Hello there", rng) is None
    assert cache.chat_label("Who made you?") == cache.chat_label("Who built you?") != cache.chat_label("Who are you?")
    assert cache.chat_label("Write a poem.") == "Write a poem."  # its own class


def test_verifiers_cascade_accuracy_and_cost(bench_module: Callable) -> None:
    from policies.policy import DEFAULT_PRICES

    verifiers = bench_module("verifiers")

    def answered(answer: str, completion: int) -> dict:
        return {"answer": answer, "prompt_tokens": 100, "completion_tokens": completion}

    def cost(r: dict, tier: str) -> Decimal:
        price = DEFAULT_PRICES[tier]
        return (r["prompt_tokens"] * price.prompt + r["completion_tokens"] * price.completion) / 1_000_000

    problems = [{"answer": "... #### 4"}, {"answer": "... #### 7"}]
    small, large = [answered("4", 50), answered("6", 50)], [answered("4", 80), answered("7", 80)]
    assert verifiers.accuracy(small, problems, "answer") == 0.5
    acc, ratio = verifiers.cascade(small, large, problems, [False, True])  # the wrong one escalated
    assert acc == 1.0
    spent = cost(small[0], "small") + cost(small[1], "small") + cost(large[1], "large")  # escalated: pays both
    assert ratio == pytest.approx(float(spent / (cost(large[0], "large") + cost(large[1], "large"))))


def test_moe_serves_the_split_with_another_top_k(tmp_path: Path, bench_module: Callable) -> None:
    moe = bench_module("moe")
    split = tmp_path / "moe"
    split.mkdir()
    (split / "config.json").write_text(json.dumps({"num_experts": 8, "num_experts_per_tok": 2}))
    (split / "model.safetensors").write_bytes(b"weights")
    served = moe.with_top_k(split, 4)
    assert json.loads((served / "config.json").read_text()) == {"num_experts": 8, "num_experts_per_tok": 4}
    assert (served / "model.safetensors").resolve() == (split / "model.safetensors").resolve()  # the same weights


def test_checks_measures_precision_and_recall_of_wrong_answers(tmp_path: Path, bench_module: Callable) -> None:
    """bench.checks on a label file of four answers to one code prompt: the two that fail its doctest are
    escalated, and the report counts them right (no engine: `prompt_examples` asks nothing)."""
    checks = bench_module("checks")
    prompt = 'Complete it.\n\n```python\ndef double(x):\n    """\n    >>> double(2)\n    4\n    """\n```'
    right, wrong = "```python\ndef double(x):\n    return 2 * x\n```", "```python\ndef double(x):\n    return x\n```"
    rows = [  # (answer, small_ok, large_ok): a check that escalates the two wrong ones is right both times
        (right, True, True), (wrong, False, True), (wrong, False, False), (right, False, True),
    ]  # fmt: skip
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(
        json.dumps({"id": f"code/{i}", "source": "code", "small_ok": ok, "large_ok": large, "small_text": text,
                    "messages": [{"role": "user", "content": prompt}]}) + "\n"
        for i, (text, ok, large) in enumerate(rows)
    ))  # fmt: skip
    _, cases = checks.load_cases(labels, tmp_path, "all")
    assert [c.text for c in cases] == [r[0] for r in rows]
    results = list(checks.measure("prompt_examples", checks.make_check("prompt_examples", tmp_path, []), cases,
                                  None, 2, "m"))  # fmt: skip
    assert [r["action"] for r in results] == ["continue", "escalate", "escalate", "continue"]
    m = checks.summarize(results)["prompt_examples"]["code"]
    assert (m["rows"], m["looked"], m["wrong"], m["escalated"], m["caught"]) == (4, 4, 3, 2, 2)
    assert (m["precision"], m["recall"]) == (1.0, round(2 / 3, 3))
    assert (m["small_acc"], m["cascade_acc"], m["large_acc"]) == (0.25, 0.5, 0.75)  # escalated: the large label
    assert m["tokens_per_row"] == 0.0  # it asked no tier
    results_file = tmp_path / "results.jsonl"
    for r in results:
        checks.append(results_file, r)
    assert set(checks.read_results(results_file, "m")) == {(f"code/{i}", "prompt_examples") for i in range(4)}
    assert checks.read_results(results_file, "another model") == {}  # a rerun resumes only its own


def test_soak_counts_ledger_rows_excused_refusals_and_growth(bench_module: Callable) -> None:
    """bench.soak's verdict on what a client saw: every 200 (a stream the client closed included) needs its
    ledger row and refusals need none; a 503 `budget_unavailable` is excused only for tenants with limits
    and only around the Redis outage; growth counts from the end of the warm-up to the end of the load."""
    soak = bench_module("soak_verdict")
    call = soak.Call
    calls = [
        call("hit", "soak-main", 1, 2, 200, request_id="a", cache="hit"),
        call("cancel", "soak-open", 3, 4, 200, request_id="b", note="closed"),  # abandoned mid-stream: billed
        call("stream", "soak-main", 5, 6, 200, request_id="c"),
        call("budget", "soak-tight", 7, 8, 429, code="insufficient_quota"),  # refused: no row
        call("bad:wrong_type", "soak-main", 9, 9.1, 400, code="invalid_value"),
        call("hit", "soak-main", 105, 105.1, 503, code="budget_unavailable"),  # Redis down: excused
        call("hit", "soak-main", 130, 130.1, 503, code="budget_unavailable"),  # 20 s after it came back: not
        call("hit", "soak-open", 106, 106.1, 503, code="budget_unavailable"),  # no limits to check: not
        call("stream", "soak-open", 140, 141, 200, request_id="d", stream_error="error event: engine_error"),
        call("bad:no_key", "soak-main", 150, 150.1, 500),
    ]
    outage = soak.Window(100.0, 110.0)
    assert [soak.judge(c, outage) for c in calls] == [
        "ok", "ok", "ok", "ok", "ok", "outage", "unexpected", "unexpected", "stream_error", "unexpected",
    ]  # fmt: skip

    def sample(t: float, phase: str, rss: float, fds: int, kv: int) -> object:
        return soak.Sample(t, phase, rss, fds, 0.0, 3, kv, 0, 0, 10, 0, 0)

    samples = [
        sample(0, "idle", 900, 10, 0),
        sample(30, "load", 1040, 20, 5),  # still warming up
        sample(60, "load", 1000, 20, 4),  # the baseline: the end of the warm-up
        sample(90, "outage", 1020, 21, 6),  # the end of the load
        sample(95, "idle-after", 1030, 15, 2),
    ]
    rows = {rid: ("soak-main", "ok", "miss") for rid in ("a", "b", "d", "x")}
    v = soak.verdict(samples, 60, calls, outage, soak.Ledger(rows, 0), 0, 2)
    assert (v.expected_rows, v.lost_rows, v.lost_examples, v.unexpected_rows, v.duplicate_ids) == (4, 1, ["c"], 1, 0)
    assert v.unexpected_5xx == 4  # the late 503, soak-open's 503, the stream's error event, the 500
    assert v.rss_growth_pct == pytest.approx(2.0) and v.fd_growth == 1 and v.kv_blocks_leaked == 2


def test_bench_tools_scores_with_bfcls_own_checker() -> None:
    """bench.tools' pieces on BFCL's real data: its OpenAI conversion, its AST checker through the stub (the
    ground truth passes, a wrong value or a missing call fails, irrelevance wants no call), the anchor's lenient
    parser, and the malformed-call count."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench import bfcl
    from bench.tools import decoded, lenient_calls, malformed

    q = next(q for q in bfcl.questions("simple_python", None) if q.id == "simple_python_0")
    (tool,) = bfcl.openai_tools(q.functions)
    assert tool["function"]["name"] == "calculate_triangle_area" and tool["function"]["parameters"]["type"] == "object"
    right = [("calculate_triangle_area", {"base": 10, "height": 5})]
    assert bfcl.correct(q, right) and not bfcl.correct(q, [("calculate_triangle_area", {"base": 9, "height": 5})])
    assert not bfcl.correct(q, [])
    dotted = next(q for q in bfcl.questions("simple_python", None) if q.id == "simple_python_1")  # math.factorial
    assert bfcl.correct(dotted, [("math_factorial", {"number": 5})])
    irrelevant = bfcl.questions("irrelevance", 1)[0]
    assert bfcl.correct(irrelevant, []) and not bfcl.correct(irrelevant, [("anything", {})])
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert lenient_calls(text) == [("f", {"a": 1})]
    assert lenient_calls('```json\n[{"name": "g", "parameters": {"b": 2}}]\n```') == [("g", {"b": 2})]
    assert decoded([["f", '{"a": 1}']]) == [("f", {"a": 1})] and decoded([["f", "{oops"]]) is None
    assert malformed(q, [["calculate_triangle_area", '{"base": 10, "height": 5}']]) == 0
    assert malformed(q, [["calculate_triangle_area", '{"base": "ten"}'], ["nope", "{}"], ["x", "{oops"]]) == 3


def test_tool_loops_counts_switches_inside_loops_and_the_prefix_later_turns_reuse(bench_module: Callable) -> None:
    summary = bench_module("tool_loops").summary
    locked = [[("small", 0, 100), ("small", 90, 120)], [("small", 0, 80), ("small", 70, 90), ("small", 85, 100)]]
    fresh = [[("small", 0, 100), ("large", 0, 120)], [("small", 0, 80), ("large", 0, 90), ("small", 70, 100)]]
    a, b = summary(locked), summary(fresh)
    assert (a["switches_inside_loops"], a["loops_that_switched"], a["tiers"]) == (0, 0, ["ss", "sss"])
    assert (b["switches_inside_loops"], b["loops_that_switched"], b["tiers"]) == (3, 2, ["sl", "sls"])
    assert a["cached_share_of_later_prompts"] == round(245 / 310, 3) and b["cached_tokens_per_later_turn"] == 23.3


def test_tool_labels_are_bfcl_questions_bench_tools_does_not_score_graded_by_its_checker() -> None:
    """bench.tool_labels' pieces on BFCL's real data: a fixed sample per category that never overlaps bench.tools'
    default one; each tier's answer graded by BFCL's checker (a failed request is wrong; irrelevance wants no call);
    the row's conversation is the one the gateway's admission hands the router for the same request."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench import bfcl
    from bench.tool_labels import BENCH_PER_CATEGORY, ID_PREFIX, label_questions, label_row, tier_models
    from gateway.http.schemas import ChatCompletionRequest
    from gateway.pipeline.prompts import chat_messages
    from gateway.tool_calls import routing_turns, tool_request
    from router_model.kinds import TOOLS, request_kind

    qs = label_questions(5)
    assert [q.id for q in qs] == [q.id for q in label_questions(5)] and len(qs) == 5 * len(bfcl.CATEGORIES)
    scored = {q.id for c in bfcl.CATEGORIES for q in bfcl.questions(c, BENCH_PER_CATEGORY)}
    assert not scored & {q.id for q in qs}
    q = next(q for q in bfcl.questions("simple_python", None) if q.id == "simple_python_0")
    answers = {
        "tiny": {"status": 500, "error": "boom"},
        "small": {"status": 200, "calls": [["calculate_triangle_area", '{"base": 10, "height": 5}']]},
        "large": {"status": 200, "calls": [["calculate_triangle_area", '{"base": 9, "height": 5}']]},
    }
    row = label_row(q, answers, tier_models())
    assert (row["tiny_ok"], row["small_ok"], row["large_ok"], row["label"]) == (False, True, False, True)
    assert row["id"] == ID_PREFIX + q.id and row["source"] == "bfcl_simple_python"
    assert row["small_model"] == "qwen2.5-coder-0.5b-instruct@int8/bf16"
    asked = {"model": "auto", "messages": q.messages, "tools": bfcl.openai_tools(q.functions), "tool_choice": "auto"}
    body = ChatCompletionRequest.model_validate(asked)
    assert row["messages"] == [*routing_turns(tool_request(body)), *chat_messages(body)]
    assert request_kind(row["messages"]) == TOOLS
    irrelevant = bfcl.questions("irrelevance", 1)[0]
    declined = {t: {"status": 200, "content": "I cannot help with that.", "calls": []} for t in answers}
    assert label_row(irrelevant, declined, tier_models())["large_ok"] is True
