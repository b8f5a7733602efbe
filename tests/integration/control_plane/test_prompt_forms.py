"""Control plane against real Redis: chat-message and template prompt sets become the run's prompt groups
and held-out prompts as the run's [prompt] section says; a model without a chat template refuses messages
when the run is created; stored sets are listed, shown and deleted with the usual auth."""

from __future__ import annotations

import pytest

from broker import Keys
from broker.keys import PROMPT_SETS
from services.wire import EvalPrompt, PromptGroup, decode
from tests.fixtures.control import NO_MODEL, READ_TOKEN, WRITE_TOKEN, run_config

MESSAGES = [
    {"messages": [{"role": "user", "content": "What is 2+2?"}], "type": "exact", "answer": "4"},
    {"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+3?"}],
     "type": "exact", "answer": "6"},
]
TEMPLATED = [{"question": f"{a}+{b}", "type": "exact", "answer": str(a + b)} for a, b in [(1, 2), (3, 4)]]


@pytest.fixture
def models(tmp_path):
    """Tokenizer folders (all the control plane reads of a model): one with a chat template, one without."""
    from examples.tiny import CHAT_TEMPLATE, char_tokenizer

    chat, base = tmp_path / "chat-model", tmp_path / "base-model"
    char_tokenizer(chat_template=CHAT_TEMPLATE).save_pretrained(chat)
    char_tokenizer().save_pretrained(base)
    return {"chat": str(chat), "base": str(base)}


async def _upload(control, lines) -> str:
    r = await control.upload(lines)
    assert r.status_code == 201, r.text
    return r.json()["id"]


async def _create(control, set_id: str, config: dict, eval_set: str | None = None):
    body = {"prompt_set_id": set_id, "config": config, "eval_prompt_set_id": eval_set}
    return await control.client.post("/v1/runs", json=body, headers=control.auth())


async def _groups(control, run_id: str) -> list[PromptGroup]:
    entries = await control.redis.xrange(Keys(run_id).prompts)
    return sorted((decode(PromptGroup, f[b"p"]) for _id, f in entries), key=lambda g: g.index)


async def test_messages_get_the_system_prompt_and_templates_are_filled_in_the_runs_groups(control, models):
    chat_set, templated = await _upload(control, MESSAGES), await _upload(control, TEMPLATED)
    config = run_config(model={"path": models["chat"]}, data={"epochs": 1},
                        prompt={"system_prompt": "Be brief.", "template": "Question: {question}\nAnswer:"})
    r = await _create(control, chat_set, config, eval_set=templated)
    assert r.status_code == 201, r.text
    groups = await _groups(control, r.json()["run_id"])
    assert [[(m.role, m.content) for m in g.messages] for g in groups] == [
        [("system", "Be brief."), ("user", "What is 2+2?")],
        [("system", "Add."), ("user", "3+3?")],  # the line's own system turn wins
    ]
    assert all(g.prompt is None for g in groups)
    # the held-out template lines: filled in, then given the system prompt (the model has a chat template)
    held_out = [decode(EvalPrompt, raw) for raw in await control.redis.lrange(Keys(r.json()["run_id"]).eval_prompts, 0, -1)]
    assert [[(m.role, m.content) for m in p.messages] for p in held_out] == [
        [("system", "Be brief."), ("user", "Question: 1+2\nAnswer:")],
        [("system", "Be brief."), ("user", "Question: 3+4\nAnswer:")],
    ]


async def test_a_base_model_gets_template_text(control, models):
    set_id = await _upload(control, TEMPLATED)
    config = run_config(model={"path": models["base"]}, data={"epochs": 1}, prompt={"template": "Q: {question}\nA:"})
    r = await _create(control, set_id, config)
    assert r.status_code == 201, r.text
    assert [g.prompt for g in await _groups(control, r.json()["run_id"])] == ["Q: 1+2\nA:", "Q: 3+4\nA:"]


async def test_messages_for_a_model_without_a_chat_template_are_422_naming_the_field_and_store_nothing(
    control, models, snapshot
):
    chat_set = await _upload(control, MESSAGES)
    before = await snapshot(control.redis)
    r = await _create(control, chat_set, run_config(model={"path": models["base"]}))
    assert r.status_code == 422, r.text
    assert [(e["line"], e["field"]) for e in r.json()["errors"]] == [(1, "messages"), (2, "messages")]
    assert "no chat template" in r.json()["detail"] and models["base"] in r.json()["detail"]
    assert await snapshot(control.redis) == before
    # the held-out set is checked the same way, and named
    plain = await _upload(control, [{"prompt": "1+1=", "type": "exact", "answer": "2"}])
    before = await snapshot(control.redis)
    r = await _create(control, plain, run_config(model={"path": models["base"]}), eval_set=chat_set)
    assert r.status_code == 422 and r.json()["detail"].startswith("eval_prompt_set_id:"), r.text
    assert await snapshot(control.redis) == before
    # a system prompt for prompt lines needs a chat template too
    r = await _create(control, plain, run_config(model={"path": models["base"]}, prompt={"system_prompt": "Hi."}))
    assert r.status_code == 422 and "prompt.system_prompt" in r.json()["detail"], r.text
    assert await snapshot(control.redis) == before
    # a model folder with no tokenizer files yet: the control plane cannot tell, the rollout server decides
    r = await _create(control, chat_set, run_config(model={"path": str(NO_MODEL)}))
    assert r.status_code == 201, r.text
    # a model.path the control plane cannot see at all is refused (control_plane.model_path)
    await control.client.post(f"/v1/runs/{r.json()['run_id']}/stop", headers=control.auth())
    r = await _create(control, chat_set, run_config(model={"path": "/nowhere/model"}))
    assert r.status_code == 422 and r.json()["detail"].startswith("model.path:"), r.text


async def test_an_unknown_placeholder_is_422_naming_the_line_and_field(control, models, snapshot):
    set_id = await _upload(control, TEMPLATED)
    before = await snapshot(control.redis)
    r = await _create(control, set_id, run_config(model={"path": models["base"]},
                                                  prompt={"template": "{question} ({level})"}))
    assert r.status_code == 422, r.text
    assert [(e["line"], e["field"]) for e in r.json()["errors"]] == [(1, "level"), (2, "level")]
    assert "prompt.template uses {level}" in r.json()["detail"]
    r = await _create(control, set_id, run_config(model={"path": models["base"]}, prompt={"template": "{qestion}"}))
    assert r.status_code == 422 and {e["field"] for e in r.json()["errors"]} == {"qestion", "question"}, r.text
    r = await _create(control, set_id, run_config(model={"path": models["base"]}))  # no template at all
    assert r.status_code == 422 and {e["field"] for e in r.json()["errors"]} == {"prompt"}, r.text
    assert await snapshot(control.redis) == before


async def test_prompt_sets_are_listed_shown_and_deleted_with_auth(control):
    first = (await control.upload(MESSAGES, token=WRITE_TOKEN)).json()["id"]  # the write token's own
    second = await _upload(control, TEMPLATED)  # the operator's
    read, write = control.auth(READ_TOKEN), control.auth(WRITE_TOKEN)
    listed = await control.client.get("/v1/prompt-sets", headers=read)
    assert listed.status_code == 200, listed.text
    assert [s["id"] for s in listed.json()] == [second, first]  # newest first
    assert listed.json()[1]["forms"] == {"messages": 2} and listed.json()[0]["forms"] == {"template": 2}
    shown = await control.client.get(f"/v1/prompt-sets/{first}", headers=read)
    assert shown.json()["count"] == 2 and shown.json()["reward_types"] == {"exact": 2}
    assert (await control.client.get("/v1/prompt-sets")).status_code == 401
    assert (await control.client.get("/v1/prompt-sets", headers=write)).status_code == 403
    assert (await control.client.delete(f"/v1/prompt-sets/{first}", headers=read)).status_code == 403
    assert (await control.client.delete(f"/v1/prompt-sets/{first}")).status_code == 401

    assert (await control.client.delete(f"/v1/prompt-sets/{second}", headers=write)).status_code == 403  # not its own
    gone = await control.client.delete(f"/v1/prompt-sets/{first}", headers=write)
    assert gone.status_code == 200 and gone.json()["id"] == first
    assert (await control.client.delete(f"/v1/prompt-sets/{first}", headers=write)).status_code == 404
    assert (await control.client.get(f"/v1/prompt-sets/{first}", headers=read)).status_code == 404
    assert [s["id"] for s in (await control.client.get("/v1/prompt-sets", headers=read)).json()] == [second]
    assert (await _create(control, first, run_config())).status_code == 404
    keys = {k.decode() async for k in control.redis.scan_iter(match=f"*{first}*")}
    assert not keys, keys  # its lines and meta are gone
    assert await control.redis.zscore(PROMPT_SETS, first) is None  # and its entry in the index
    store = control.app.state.prompt_sets
    left = await store.stored_bytes()  # its bytes no longer count against the stored total
    assert await _upload(control, MESSAGES) == first  # the same content stores again
    assert await store.stored_bytes() > left
