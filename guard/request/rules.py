"""What the replicas accept: the OpenAI body rules the guard checks before pricing.

The guard refuses what its replicas would refuse, with the same status and error ``code`` the
kvguard engine answers (``engine/openai_request.py``), so a request that can never be served
costs no budget, no blocks and no upstream call. :class:`ReplicaRules` is what the guard knows
about its replicas from their state documents:

* always: valid JSON object nested at most ``MAX_JSON_DEPTH`` (64) levels; ``model`` a string, ``stream`` a boolean, ``temperature`` in
  [0, 2], ``top_p`` in [0, 1], integer ``n`` / ``max_tokens`` >= 1; a ``prompt`` (string,
  non-empty token ids, or a batch of one) or non-empty ``messages`` with a known ``role``;
* ``served_models`` known (every replica publishes ``/kvguard/state``): another ``model`` is
  404 ``model_not_found``;
* ``strict`` (every replica is a kvguard engine): no field it cannot honour
  (``serving/unsupported_params.py``: ``best_of``, ``tools``, ...), ``n`` must be 1 and every
  message needs string or text-part content. In front of vLLM or an unknown app these are left to the upstream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from guard.errors import PricingError
from serving.json_body import MAX_JSON_DEPTH, loads, nesting_depth_exceeds
from serving.unsupported_params import UNSUPPORTED_PARAMS, first_unsupported

__all__ = ["ROLES", "ReplicaRules", "chat_texts", "check_common", "optional_int", "parse_body",
           "completion_prompt", "response_input_texts"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_UNSUPPORTED_NAMES = frozenset(UNSUPPORTED_PARAMS)


@dataclass(frozen=True)
class ReplicaRules:
    """Limits and dialect of the replicas behind the guard (from their state documents)."""

    max_model_len: int | None = None  # None: unknown, the upstream checks the context
    block_size: int = 16
    served_models: frozenset[str] | None = None  # None: unknown, any model passes
    strict: bool = False  # every replica is a kvguard engine


def _bad(message: str, param: str | None, code: str = "invalid_value") -> PricingError:
    return PricingError(400, code, message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_body(body: dict | bytes) -> dict:
    """The JSON object in ``body`` (already parsed when a dict)."""
    if isinstance(body, (bytes, bytearray)):
        # json.loads recurses once per level; the bracket count is nesting_depth_exceeds's own
        # first test, here without the call for the bodies it lets through
        if (body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
                and nesting_depth_exceeds(body, MAX_JSON_DEPTH)):
            raise _bad(f"request body nests deeper than {MAX_JSON_DEPTH} levels", None,
                       "invalid_json")
        try:
            body = loads(body)  # orjson where it parses as the stdlib would
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise _bad(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object", None, "invalid_json")
    return body


def optional_int(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):  # _is_int, inlined
        raise _bad(f"'{name}' must be an integer", name, "invalid_type")
    if value < minimum:
        raise _bad(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def check_common(body: dict, rules: ReplicaRules) -> int:
    """The fields every request shares; returns ``n`` (the number of choices)."""
    # the kvguard engine refuses the fields it cannot honour, first (looked at only when the
    # body has one of them)
    if rules.strict and not _UNSUPPORTED_NAMES.isdisjoint(body):
        unsupported = first_unsupported(body)
        if unsupported is not None:
            raise _bad(f"'{unsupported}' is not supported by this server", unsupported,
                       "unsupported_parameter")
    get = body.get
    model = get("model")
    if model is not None:
        if not isinstance(model, str):
            raise _bad("'model' must be a string", "model", "invalid_type")
        served = rules.served_models
        if served is not None and model not in served:
            raise PricingError(404, "model_not_found", f"The model `{model}` does not exist or "
                               "you do not have access to it.", "model")
    stream = get("stream")
    if stream is not None and stream is not True and stream is not False:
        raise _bad("'stream' must be a boolean", "stream", "invalid_type")
    for name, high in _RANGED:
        value = get(name)
        if value is not None:
            if not _is_number(value):
                raise _bad(f"'{name}' must be a number", name, "invalid_type")
            if not 0.0 <= value <= high:
                raise _bad(f"'{name}' must be between 0.0 and {high}, got {value}", name)
    n = get("n")
    if n is None:
        return 1
    if rules.strict:  # the kvguard engine: one choice
        if not _is_int(n):
            raise _bad("'n' must be an integer", "n", "invalid_type")
        if n != 1:
            raise _bad(f"only n=1 is supported, got n={n}", "n", "unsupported_value")
        return 1
    return optional_int(body, "n", 1)


_RANGED = (("temperature", 2.0), ("top_p", 1.0))


def completion_prompt(body: dict) -> str | list[int]:
    """A completion's prompt: non-empty text, or a non-empty list of token ids."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("you must provide a 'prompt'", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise _bad("only one prompt per request is supported", "prompt", "unsupported_value")
    if not isinstance(prompt, (str, list)):
        raise _bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    if not prompt:
        raise _bad("'prompt' must not be empty", "prompt")
    if isinstance(prompt, list) and not _token_ids(prompt):
        raise _bad("'prompt' token ids must be non-negative integers", "prompt", "invalid_type")
    return prompt


_INT_ONLY = {int}


def _token_ids(prompt: list) -> bool:
    """Every item a non-negative int (not a bool). JSON's integers are exact ``int``s: one
    C-level pass over their types and a ``min`` decide them (a per-item Python check cost
    more than the rest of a shed's pricing for a few dozen ids); anything else takes the
    per-item check."""
    if set(map(type, prompt)) == _INT_ONLY:
        return min(prompt) >= 0
    return all(_is_int(t) and t >= 0 for t in prompt)


def chat_texts(body: dict, rules: ReplicaRules) -> list[str]:
    """The text of every chat message, checked as the replicas check it."""
    messages = body.get("messages")
    if messages is None:
        raise _bad("you must provide 'messages'", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    texts: list[str] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise _bad(f"messages[{i}] must be an object with a 'role' in {sorted(ROLES)}",
                       f"messages[{i}].role", "invalid_type")
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(_part_texts(content, i, rules.strict))
        elif rules.strict or content is not None or message["role"] != "assistant":
            raise _bad(f"messages[{i}].content must be a string or a list of text parts",
                       f"messages[{i}].content", "invalid_type")
    return texts


def _part_texts(parts: list, index: int, strict: bool) -> list[str]:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or (strict and kind != "text") or (
                kind == "text" and not isinstance(part.get("text"), str)):
            raise _bad(f"messages[{index}].content must be a string or a list of text parts",
                       f"messages[{index}].content", "invalid_type")
        if kind == "text":
            texts.append(part["text"])
    return texts


def response_input_texts(body: dict) -> tuple[list[str], int]:
    """A ``/v1/responses`` body's text (``instructions`` and every ``input`` item) and the
    number of items: ``input`` is a string or a list of items — messages whose ``content`` is
    a string or parts (``input_text``/``output_text`` carry ``text``), tool calls and their
    outputs (``arguments``, ``output``); an item of another shape counts as its JSON text, so
    it is never priced at nothing."""
    texts: list[str] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions", "invalid_type")
        texts.append(instructions)
    items = body.get("input")
    if items is None:
        raise _bad("you must provide 'input'", "input", "missing_required_parameter")
    if isinstance(items, str):
        if not items:
            raise _bad("'input' must not be empty", "input")
        texts.append(items)
        return texts, 1
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items", "input",
                   "invalid_type")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _bad(f"input[{i}] must be an object", f"input[{i}]", "invalid_type")
        texts.extend(_item_texts(item, i))
    return texts, len(items)


def _item_texts(item: dict, index: int) -> list[str]:
    content = item.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise _bad(f"input[{index}].content must be a string or a list of parts",
                           f"input[{index}].content", "invalid_type")
            text = part.get("text")
            texts.append(text if isinstance(text, str) else json.dumps(part))
        return texts
    if content is not None:
        raise _bad(f"input[{index}].content must be a string or a list of parts",
                   f"input[{index}].content", "invalid_type")
    known = [item[name] for name in ("arguments", "output") if isinstance(item.get(name), str)]
    return known or [json.dumps(item)]
