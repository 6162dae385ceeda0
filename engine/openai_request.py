"""Parsing and validating an OpenAI ``/v1/completions`` or ``/v1/chat/completions`` body.

``parse_generation_request(...)`` turns raw body bytes into a frozen ``GenerationRequest`` or
raises ``ApiError`` carrying the OpenAI-style error (status, message, type, param, code).
Supported: ``prompt`` (string, token id list, or a one-element list of either), ``messages``,
``model`` (must be the served name, else 404 ``model_not_found``), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``n`` (1),
``stream``, ``stream_options.include_usage``, and the vLLM extensions ``ignore_eos``,
``priority`` and ``cache_salt`` (a non-empty string: only requests with the same salt share
cached prefix blocks). Every message needs string (or text-part) content. Fields this server
cannot honour (``best_of``, ``tools``, ``logit_bias``, ...: ``serving/unsupported_params.py``) are a
400 ``unsupported_parameter`` unless neutral; other unknown fields are ignored, as vLLM does.
The body nests at most ``MAX_JSON_DEPTH`` levels (``serving/json_body.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from serving.chat_template import CHAT_ROLES, message_text
from serving.json_body import JsonBodyError, decode_json_object
from serving.unsupported_params import first_unsupported

__all__ = ["ApiError", "GenerationRequest", "parse_generation_request"]

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default
_ROLES = CHAT_ROLES
_MISSING = object()


class ApiError(Exception):
    """An error answered to the client as ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)


@dataclass(frozen=True)
class GenerationRequest:
    chat: bool
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    priority: int
    cache_salt: str | None = None


def _bad(message: str, param: str | None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _typed(body: dict, name: str, kinds: tuple[type, ...], label: str, default=None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise _bad(f"'{name}' must be {label}, got {json.dumps(value)}", name, "invalid_type")
    if not isinstance(value, kinds):
        raise _bad(f"'{name}' must be {label}, got {json.dumps(value)[:40]}", name,
                   "invalid_type")
    return value


def _ranged(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = float(_typed(body, name, (int, float), "a number", default))
    if not low <= value <= high:
        raise _bad(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _decode_body(raw: bytes) -> dict:
    try:
        body = decode_json_object(raw)
    except JsonBodyError as exc:
        raise _bad(exc.message, None, exc.code) from None
    unsupported = first_unsupported(body)
    if unsupported is not None:
        raise _bad(f"'{unsupported}' is not supported by this server", unsupported,
                   "unsupported_parameter")
    return body


def _token_ids(value, param: str) -> tuple[int, ...]:
    if not value:
        raise _bad(f"'{param}' must not be empty", param)
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise _bad(f"'{param}' token ids must be non-negative integers", param, "invalid_type")
    return tuple(value)


def _encode(tokenizer, text: str, param: str) -> tuple[int, ...]:
    if tokenizer is None:
        raise _bad("this replica has no tokenizer: send the prompt as a list of token ids",
                   param, "unsupported_value")
    if not text:
        raise _bad(f"'{param}' must not be empty", param)
    return _token_ids(tokenizer.encode(text), param)


def _prompt_ids(body: dict, tokenizer) -> tuple[int, ...]:
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise _bad("you must provide a 'prompt'", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise _bad("only one prompt per request is supported", "prompt", "unsupported_value")
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt")
    raise _bad("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")


def _message_text(content, index: int) -> str:
    text = message_text(content)
    if text is not None:
        return text
    raise _bad(f"messages[{index}].content must be a string or a list of text parts",
               f"messages[{index}].content", "invalid_type")


def _chat_ids(body: dict, tokenizer) -> tuple[int, ...]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise _bad("you must provide 'messages'", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    rendered = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] must be an object with a 'role' in {sorted(_ROLES)}",
                       f"messages[{i}].role", "invalid_type")
        rendered.append({"role": msg["role"], "content": _message_text(msg.get("content"), i)})
    if tokenizer is None:
        raise _bad("this replica has no tokenizer: use /v1/completions with token ids",
                   "messages", "unsupported_value")
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    except Exception as exc:  # the shapes were checked above: whatever is left is the input's
        raise _bad(f"cannot render the chat template: {exc}", "messages") from None
    return _encode(tokenizer, text, "messages")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop", "invalid_type")
    return tuple(stops)


def _max_tokens(body: dict, chat: bool, num_prompt: int, max_model_len: int,
                default_limit: int) -> int:
    value = _typed(body, "max_completion_tokens", (int,), "an integer") if chat else None
    name = "max_completion_tokens" if value is not None else "max_tokens"
    if value is None:
        value = _typed(body, "max_tokens", (int,), "an integer")
    if value is None:
        value = default_limit - num_prompt if chat else _COMPLETIONS_DEFAULT_MAX_TOKENS
    elif value < 1:
        raise _bad(f"'{name}' must be at least 1, got {value}", name)
    if num_prompt >= max_model_len or num_prompt + value > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {num_prompt + max(value, 1)} tokens ({num_prompt} in "
                       f"the prompt, {max(value, 1)} for the completion). Please reduce the length "
                       f"of the prompt or completion.", param=name,
                       code="context_length_exceeded")
    return value


def _check_model_and_n(body: dict, model_name: str) -> None:
    model = _typed(body, "model", (str,), "a string")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access "
                       "to it.", param="model", code="model_not_found")
    n = _typed(body, "n", (int,), "an integer", 1)
    if n != 1:
        raise _bad(f"only n=1 is supported, got n={n}", "n", "unsupported_value")
    if body.get("logprobs") not in (None, False) or body.get("echo"):
        param = "echo" if body.get("echo") else "logprobs"
        raise _bad(f"'{param}' is not supported by this server", param, "unsupported_value")


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return bool(_typed(options, "include_usage", (bool,), "a boolean", False))


def _cache_salt(body: dict) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _bad(f"'cache_salt' must be a non-empty string, got {json.dumps(salt)[:40]}",
                   "cache_salt", "invalid_type")
    return salt


def _sampling(body: dict, max_tokens: int) -> SamplingParams:
    top_k = _typed(body, "top_k", (int,), "an integer")
    if top_k is not None and top_k < -1:
        raise _bad(f"'top_k' must be -1 (off) or at least 1, got {top_k}", "top_k")
    if top_k is not None and top_k <= 0:
        top_k = None  # vLLM: -1 / 0 disable the filter
    top_p = _ranged(body, "top_p", 0.0, 1.0, 1.0)
    if top_p == 0.0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    return SamplingParams(
        max_tokens=max_tokens, temperature=_ranged(body, "temperature", 0.0, 2.0, 1.0),
        top_p=top_p, top_k=top_k, seed=_typed(body, "seed", (int,), "an integer"),
        ignore_eos=_typed(body, "ignore_eos", (bool,), "a boolean", False))


def parse_generation_request(raw: bytes, *, chat: bool, model_name: str, tokenizer,
                             max_model_len: int,
                             max_pool_tokens: int | None = None) -> GenerationRequest:
    """Validate one request body; raises ``ApiError`` (400, or 404 for an unknown model).

    A chat request without ``max_tokens`` may generate up to the context limit, capped by
    ``max_pool_tokens`` (what the whole KV pool holds) so that it stays servable.
    """
    body = _decode_body(raw)
    _check_model_and_n(body, model_name)
    stream = bool(_typed(body, "stream", (bool,), "a boolean", False))
    include_usage = _include_usage(body, stream)
    stop = _stop(body)
    priority = _typed(body, "priority", (int,), "an integer", 0)
    cache_salt = _cache_salt(body)
    prompt = _chat_ids(body, tokenizer) if chat else _prompt_ids(body, tokenizer)
    default_limit = min(max_model_len, max_pool_tokens or max_model_len)
    max_tokens = _max_tokens(body, chat, len(prompt), max_model_len, default_limit)
    return GenerationRequest(chat=chat, prompt_token_ids=prompt,
                             params=_sampling(body, max_tokens), stream=stream,
                             include_usage=include_usage, stop=stop, priority=priority,
                             cache_salt=cache_salt)
