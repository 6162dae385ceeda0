"""The guard's ``chat_template`` key: read and validated at config load (errors name the key),
rendered exactly as the engine renders (one shared function), and what the precise view does
with a chat request the template cannot render (priced uncached, counted, logged once)."""

import json
import logging
import sys

import pytest

from guard.config import GuardConfig
from guard.replicas.block_hashes import token_block_hashes
from guard.replicas.prefix_cache import PrefixCacheView
from guard.request.chat_template import load_chat_template

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SYSTEM = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def tokenizer_config(tmp_path, **fields):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>",
                                "eos_token": {"content": "</s>", "special": True}, **fields}))
    return str(path)


def precise(tmp_path, path):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")  # the key is a path; the pricer reads it later, not here
    return GuardConfig.from_dict({"prefix_cache": "precise", "tokenizer": str(tokenizer),
                                  "chat_template": path})


def test_a_tokenizer_config_gives_the_template_and_its_special_tokens(tmp_path):
    template = precise(tmp_path, tokenizer_config(tmp_path)).loaded_chat_template
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>")
    assert template.render({"messages": SYSTEM}) == (
        "<s><|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>", "")
    named = tokenizer_config(tmp_path, chat_template=[
        {"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ 1 + 1 }}"}])
    assert load_chat_template(named).render({"messages": SYSTEM}) == ("2", "")


def test_a_raw_jinja_file_is_a_template_without_special_tokens(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert load_chat_template(str(path)).render({"messages": SYSTEM}) == (
        "[system] Be brief.\n[user] Hi\n", "")


def test_the_guard_renders_exactly_as_the_engine(tmp_path):
    from engine.tokenizer import Tokenizer

    engine = Tokenizer(["<s>", "</s>", "a"], [], [3, 3, 1], bos_token_id=0, eos_token_id=1,
                       chat_template=TEMPLATE)
    guard = load_chat_template(tokenizer_config(tmp_path))
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    body = {"messages": [{"role": "developer", "content": parts, "name": "ops"},
                         {"role": "user", "content": "Hi"}]}
    engine_messages = [{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": "Hi"}]
    assert guard.render(body)[0] == engine.apply_chat_template(engine_messages)


@pytest.mark.parametrize("write, match", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    (json.dumps(["a list"]), "JSON object"),
    (json.dumps({"bos_token": "<s>"}), "no chat_template"),
    (json.dumps({"chat_template": "{% for m in messages %}"}), "does not compile"),
    (json.dumps({"chat_template": "x", "eos_token": 7}), "eos_token"),
    (json.dumps({"chat_template": "  "}), "empty template"),
])
def test_a_bad_tokenizer_config_is_a_value_error_naming_the_key(tmp_path, write, match):
    path = tmp_path / "tokenizer_config.json"
    if write is not None:
        path.write_text(write)
    with pytest.raises(ValueError, match=f"^chat_template: .*{match}"):
        precise(tmp_path, str(path))


def test_a_raw_template_cannot_use_special_tokens_it_does_not_define(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text("{{ bos_token }}{{ messages[0].content }}")
    with pytest.raises(ValueError, match="^chat_template: .*tokenizer_config.json"):
        precise(tmp_path, str(path))


def test_the_key_needs_the_precise_view(tmp_path):
    with pytest.raises(ValueError, match="^chat_template: .*precise"):
        GuardConfig.from_dict({"chat_template": tokenizer_config(tmp_path)})


def test_without_jinja2_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    with pytest.raises(ValueError, match=r"^chat_template: .*kvguard\[kv-events\]"):
        precise(tmp_path, tokenizer_config(tmp_path))


@pytest.mark.parametrize("extra, why", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "'tools'"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "'chat_template_kwargs'"),
    ({"add_generation_prompt": False}, "'add_generation_prompt'"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "content"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": [{"role": "user", "content": "boom"}]}, "the template raised"),
])
def test_what_the_template_cannot_render_as_the_replica_would_is_none(tmp_path, extra, why):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"chat_template": (
        "{% if messages[0].content == 'boom' %}{{ raise_exception('no') }}{% endif %}"
        + TEMPLATE)}))
    text, reason = load_chat_template(str(path)).render({"messages": SYSTEM, **extra})
    assert text is None and why in reason


def test_neutral_values_of_those_fields_still_render(tmp_path):
    template = load_chat_template(tokenizer_config(tmp_path))
    body = {"messages": SYSTEM, "tools": [], "add_generation_prompt": True,
            "chat_template_kwargs": {}, "continue_final_message": False}
    assert template.render(body)[0] is not None


def test_the_precise_view_hashes_the_rendered_chat_and_counts_what_it_cannot(tmp_path, caplog):
    template = load_chat_template(tokenizer_config(tmp_path))
    ids = lambda text: [ord(c) for c in text]  # noqa: E731 - a tokenizer of code points
    view = PrefixCacheView("precise", token_ids=ids, chat_template=template)
    key = view.key({"model": "m", "messages": SYSTEM}, True, 40, 4.0, None)
    rendered = "<s><|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>"
    assert key.hashes == token_block_hashes(ids(rendered), 16, "m") and len(key.hashes) == 3
    with caplog.at_level(logging.WARNING, logger="kvguard.prefix_cache"):
        for _ in range(3):
            bad = {"model": "m", "messages": [{"role": "narrator", "content": "x" * 64}]}
            assert view.key(bad, True, 40, 4.0, None).hashes == ()
    assert view.num_unrendered_chats == 3
    assert caplog.text.count("cannot render") == 1
    # no template: chat is priced uncached, as before, and not counted as a failure
    plain = PrefixCacheView("precise", token_ids=ids)
    assert plain.key({"model": "m", "messages": SYSTEM}, True, 40, 4.0, None).hashes == ()
    assert plain.num_unrendered_chats == 0


def test_the_pricer_counts_a_rendered_chat_prompt_exactly(tmp_path):
    from guard.request.pricing import Pricer

    config = precise(tmp_path, tokenizer_config(tmp_path))
    ids = lambda text: [ord(c) for c in text]  # noqa: E731 - a tokenizer of code points
    view = PrefixCacheView("precise", token_ids=ids, chat_template=config.loaded_chat_template)
    pricer = Pricer(config, tokenizer=lambda text: len(text) // 4, prefix_view=view)

    def price(body):
        return pricer.price_request(body, "/v1/chat/completions", {}, config.anonymous_tenant,
                                    0.0, max_model_len=4096, block_size=16)

    rendered = "<s><|system|>Be brief.</s>\n<|user|>Hi</s>\n<|assistant|>"
    priced = price({"model": "m", "messages": SYSTEM, "max_tokens": 4})
    assert priced.cost.num_prompt_tokens == len(rendered) and priced.num_overhead_tokens == 0
    assert priced.is_exact and view.num_unrendered_chats == 0
    # unrenderable: the estimate as before (texts' tokens plus the overhead), counted once
    priced = price({"model": "m", "messages": SYSTEM, "max_tokens": 4,
                    "chat_template_kwargs": {"x": 1}})
    assert priced.num_overhead_tokens > 0 and priced.cost.prefix_key.hashes == ()
    assert view.num_unrendered_chats == 1
