"""OpenAI request fields this engine cannot honour: refused, never silently ignored.

A field in ``UNSUPPORTED_PARAMS`` is accepted only at a value that changes nothing (absent,
``null``, or its neutral value such as ``best_of: 1`` or ``tools: []``, which clients and
frameworks often send); any other value is a 400 ``unsupported_parameter`` naming the field.
Fields that do not change the generated text (``user``, ``metadata``, ``store``,
``service_tier``, ``parallel_tool_calls`` without tools, ...) are ignored, as OpenAI-compatible
servers do. ``logprobs``/``echo`` and ``n`` are checked with the sampling fields.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["UNSUPPORTED_PARAMS", "first_unsupported"]

# field -> the values that mean "not used" (compared with ==, so 0 also matches 0.0)
UNSUPPORTED_PARAMS: Mapping[str, tuple] = {
    # completions
    "best_of": (1,),
    "suffix": ("",),
    # sampling we do not implement
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),  # vLLM extension
    "min_tokens": (0,),  # vLLM extension
    "top_logprobs": (0,),
    # tools and structured output
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "guided_json": (),  # vLLM extensions
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    # other modalities and features
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
}


def _is_neutral(value, neutral: tuple) -> bool:
    if value is None:
        return True
    if isinstance(value, bool):  # True == 1 in Python; a boolean is never a neutral number
        return False
    return any(value == n for n in neutral)


def first_unsupported(body: Mapping) -> str | None:
    """The first field of ``body`` this engine would have to ignore, or None."""
    for key in body:  # a body has a handful of fields: look only when one is listed
        if key in UNSUPPORTED_PARAMS:
            break
    else:
        return None
    for name, neutral in UNSUPPORTED_PARAMS.items():
        if not _is_neutral(body.get(name), neutral):
            return name
    return None
