"""Tenants' LoRA adapters on a live gateway (`gateway.adapters`, `gateway.api.adapters`): uploaded as PEFT saves
them, checked before anything is kept, served as `model: "small:NAME"` (and as the small tier's default when the
policy says so) to that tenant only, several tenants' in one batch, each keyed apart in the response cache and
named in the ledger.

The adapters are random (B scaled up) on SmolLM2-135M, so each one's greedy answer differs from the base's and
from the other's; the engine's own agreement with transformers + PEFT is tests/engines/test_lora.py's.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from lora_adapters import make_adapter

from engines.async_engine import AsyncEngine
from gateway.accounting.tenants import create_key, create_tenant
from live import LiveServer, serve_gateway
from tiny import tiny_hf_model

pytest.importorskip("peft")

PROMPT = "The capital of France is"
NO_CACHE = {"cache": "no-cache"}  # answers are stored but not read: each request runs
HOMES: dict[str, Path] = {}  # each live gateway's home folder


@pytest.fixture(scope="module")
def live(small_engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    home: Path = tmp_path_factory.mktemp("adapters")
    server, stop = serve_gateway(small_engine, home, f"sqlite:///{home / 'db.sqlite'}")
    HOMES[server.base_url] = home
    yield server
    stop()


@pytest.fixture(scope="module")
def files(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("peft")
    tiny = tiny_hf_model("llama", out / "tiny")
    return {
        "a": make_adapter(smollm2_dir, out / "a", 1),
        "b": make_adapter(smollm2_dir, out / "b", 2),
        "tiny": make_adapter(tiny, out / "tiny-adapter", 3),  # another model's shapes
    }


def tenant(live: LiveServer) -> tuple[str, str, str]:
    """A new tenant's name, admin key and app key."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = create_tenant(live.db, name, role="admin").key
    return name, admin, create_key(live.db, name, "app").key


def upload(
    live: LiveServer, tenant: str, admin: str, adapter: Path, tier: str = "small", **form: str
) -> httpx.Response:
    files = {"config": (adapter / "adapter_config.json").read_bytes(),
             "weights": (adapter / "adapter_model.safetensors").read_bytes()}  # fmt: skip
    return httpx.post(f"{live.base_url}/v1/admin/tenants/{tenant}/adapters", headers=auth(admin), timeout=60,
                      data={"tier": tier, **form}, files=files)  # fmt: skip


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(live: LiveServer, key: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **NO_CACHE, **extra}
    return httpx.post(f"{live.base_url}/v1/completions", headers=auth(key), json=body, timeout=120)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_two_tenants_adapters_in_one_batch_each_get_their_own_answer(live: LiveServer, files: dict) -> None:
    (a_name, a_admin, a_key), (b_name, b_admin, b_key) = tenant(live), tenant(live)
    # The same name in both tenants: two adapters, each tenant's own.
    assert upload(live, a_name, a_admin, files["a"], name="support").status_code == 201
    assert upload(live, b_name, b_admin, files["b"], name="support").status_code == 201
    alone = {key: text(complete(live, key, "small:support")) for key in (a_key, b_key)}
    base = text(complete(live, a_key, "small"))
    assert len({alone[a_key], alone[b_key], base}) == 3, (alone, base)
    # At once: the engine batches them, adapters and base mixed. Five prompts of six tokens keep a prefill step
    # under 33 rows: past that oneDNN's bf16 product of the base weights gives rows other bits on some CPUs (Xeon),
    # which a random adapter's chaotic model turns into other tokens; the adapters' own deltas do not depend on the
    # batch (tests/engines/test_lora.py).
    adapted_a, adapted_b, plain = (a_key, "small:support"), (b_key, "small:support"), (a_key, "small")
    asks = [adapted_a, adapted_b, plain, adapted_a, adapted_b]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda ask: text(complete(live, *ask)), asks))
    assert together == [alone[a_key], alone[b_key], base, alone[a_key], alone[b_key]]
    response = complete(live, a_key, "small:support")
    assert response.json()["model"] == "small:support" and response.headers["x-switchboard-tier"] == "small"
    (row,) = live.wait_for_usage(response.json()["id"])
    assert row.requested_model == "small:support" and row.tier == "small" and row.model.endswith("+support")


def test_an_unknown_or_another_tenants_adapter_is_404_and_models_lists_only_ones_own(
    live: LiveServer, files: dict
) -> None:
    (a_name, a_admin, a_key), (_, b_admin, b_key) = tenant(live), tenant(live)
    assert upload(live, a_name, a_admin, files["a"], name="only-a").status_code == 201
    for key, model in ((b_key, "small:only-a"), (a_key, "small:nothing"), (a_key, "nowhere:only-a")):
        r = complete(live, key, model)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    chat = httpx.post(f"{live.base_url}/v1/chat/completions", headers=auth(b_key), timeout=60,
                      json={"model": "small:only-a", "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.status_code == 404
    listed = {m["id"] for m in httpx.get(f"{live.base_url}/v1/models", headers=auth(a_key)).json()["data"]}
    assert {"small", "small:only-a"} <= listed
    others = {m["id"] for m in httpx.get(f"{live.base_url}/v1/models", headers=auth(b_key)).json()["data"]}
    assert "small:only-a" not in others and "small" in others
    assert httpx.get(f"{live.base_url}/v1/models/small:only-a", headers=auth(a_key)).status_code == 200
    assert httpx.get(f"{live.base_url}/v1/models/small:only-a", headers=auth(b_key)).status_code == 404
    # Another tenant's admin sees neither the adapter nor the tenant; the app key is no admin.
    assert httpx.get(f"{live.base_url}/v1/admin/tenants/{a_name}/adapters", headers=auth(b_admin)).status_code == 404
    assert httpx.get(f"{live.base_url}/v1/admin/tenants/{a_name}/adapters", headers=auth(a_key)).status_code == 403
    mine = httpx.get(f"{live.base_url}/v1/admin/tenants/{a_name}/adapters", headers=auth(a_admin)).json()
    assert [(m["model"], m["rank"], m["source"]) for m in mine] == [("small:only-a", 4, "uploaded")]
    gone = httpx.delete(f"{live.base_url}/v1/admin/tenants/{a_name}/adapters/small/only-a", headers=auth(b_admin))
    assert gone.status_code == 404


def test_a_bad_adapter_is_400_and_nothing_is_kept(live: LiveServer, files: dict, tmp_path: Path) -> None:
    name, admin, key = tenant(live)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((files["a"] / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file
    r = upload(live, name, admin, bad, name="corrupt")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter", r.text
    assert "cannot be read" in r.json()["error"]["message"]
    r = upload(live, name, admin, files["tiny"], name="foreign")  # another model's shapes
    assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"], r.text
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((files["a"] / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    (dora / "adapter_model.safetensors").write_bytes((files["a"] / "adapter_model.safetensors").read_bytes())
    r = upload(live, name, admin, dora, name="dora")
    assert r.status_code == 400 and "use_dora" in r.json()["error"]["message"], r.text
    assert upload(live, name, admin, files["a"], name="Bad Name").status_code == 400
    assert upload(live, name, admin, files["a"], tier="huge", name="x").status_code == 400
    listed = httpx.get(f"{live.base_url}/v1/admin/tenants/{name}/adapters", headers=auth(admin)).json()
    assert listed == []
    folder = HOMES[live.base_url] / "adapters"
    kept = [p for p in folder.rglob("*") if p.is_dir() and p.parent.name == f"t{live_tenant_id(live, name)}"]
    assert kept == []  # no staging folder, no digest folder left for the tenant
    assert complete(live, key, "small:corrupt").status_code == 404
    # The same name twice is a conflict unless replacing; a replaced adapter serves its new files.
    assert upload(live, name, admin, files["a"], name="v").status_code == 201
    assert upload(live, name, admin, files["b"], name="v").status_code == 409
    first = text(complete(live, key, "small:v"))
    assert upload(live, name, admin, files["b"], name="v", replace="true").status_code == 201
    assert text(complete(live, key, "small:v")) != first


def live_tenant_id(live: LiveServer, name: str) -> int:
    from gateway.accounting.tenants import tenant_by_name

    found = tenant_by_name(live.db, name)
    assert found is not None
    return found.id


def test_the_response_cache_keys_on_the_adapter(live: LiveServer, files: dict) -> None:
    name, admin, key = tenant(live)
    assert upload(live, name, admin, files["a"], name="support").status_code == 201
    base = complete(live, key, "small", cache="default")
    assert base.headers["x-switchboard-cache"] == "miss"
    adapted = complete(live, key, "small:support", cache="default")  # the same prompt: not the base's answer
    assert adapted.headers["x-switchboard-cache"] == "miss" and text(adapted) != text(base)
    again = complete(live, key, "small:support", cache="default")
    assert again.headers["x-switchboard-cache"] == "hit" and text(again) == text(adapted)
    assert complete(live, key, "small", cache="default").headers["x-switchboard-cache"] == "hit"


def test_a_policy_default_adapter_serves_the_tier_and_is_kept_while_named(live: LiveServer, files: dict) -> None:
    name, admin, key = tenant(live)
    policy_url = f"{live.base_url}/v1/admin/tenants/{name}/policy"
    missing = httpx.put(policy_url, headers=auth(admin), json={"adapters": {"small": "support"}}, timeout=30)
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "adapters.small", missing.text
    unserved = httpx.put(policy_url, headers=auth(admin), json={"adapters": {"huge": "support"}}, timeout=30)
    assert unserved.status_code == 422
    base = text(complete(live, key, "small"))
    assert upload(live, name, admin, files["a"], name="support").status_code == 201
    adapted = text(complete(live, key, "small:support"))
    assert httpx.put(policy_url, headers=auth(admin), json={"adapters": {"small": "support"}}).status_code == 200
    response = complete(live, key, "small")
    assert text(response) == adapted
    (row,) = live.wait_for_usage(response.json()["id"])
    assert row.model.endswith("+support")
    adapter_url = f"{live.base_url}/v1/admin/tenants/{name}/adapters/small/support"
    refused = httpx.delete(adapter_url, headers=auth(admin))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_in_use"
    assert httpx.put(policy_url, headers=auth(admin), json={}).status_code == 200
    assert httpx.delete(adapter_url, headers=auth(admin)).status_code == 204
    assert text(complete(live, key, "small")) == base
    assert complete(live, key, "small:support").status_code == 404
    actions = [e["action"] for e in httpx.get(f"{live.base_url}/v1/admin/audit", headers=auth(admin)).json()]
    assert "adapter.register" in actions and "adapter.delete" in actions
