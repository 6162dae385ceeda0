"""Chat templates rendered the one way kvguard renders them, for the engine and the guard.

The engine turns a chat request into its prompt with the model's template
(``engine.tokenizer.Tokenizer.apply_chat_template``); the guard's precise prefix-cache view
renders the same messages with the same template to know which blocks the engine will hash
(``guard.request.chat_template``). Both call this module, so the two renderings cannot drift.

The semantics are Hugging Face's ``apply_chat_template``: a sandboxed jinja2 environment
(immutable: the template cannot change what it is given) with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII
text, a ``raise_exception(message)`` global; the template sees ``messages``,
``add_generation_prompt`` and the ``bos_token`` / ``eos_token`` strings. The rendered text is
then encoded with special-token strings as single ids and no added BOS (each side's tokenizer
does that part).

jinja2 is imported only when a template is compiled: the engine extra has it, and a guard that
sets ``chat_template`` needs the ``kv-events`` extra (its precise view).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CHAT_ROLES", "chat_messages", "compile_chat_template", "message_text",
           "render_chat_template"]

# the roles a kvguard engine accepts (OpenAI's, ``developer`` included)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def compile_chat_template(source: str) -> Any:
    """The compiled template (a ``jinja2.Template``); jinja2's ``TemplateSyntaxError`` (a
    ValueError's sibling: callers name their own key) when it does not compile; ImportError
    when jinja2 is not installed."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat_template(template: Any, messages: Sequence[Mapping[str, Any]], *,
                         bos_token: str, eos_token: str, add_generation_prompt: bool = True,
                         **kwargs: Any) -> str:
    """``template`` rendered for ``messages`` (whatever the template raises propagates)."""
    special = {"bos_token": bos_token, "eos_token": eos_token}
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           **{**special, **kwargs})


def message_text(content: object) -> str | None:
    """A message's text as the engine renders it: a string as is, a list of text parts joined;
    None for anything else (images, other part types, non-strings)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    return None


def chat_messages(messages: object) -> list[dict[str, str]] | None:
    """The messages as the engine hands them to its template (``role`` and text ``content``
    only); None when one of them is not something the engine renders (an unknown role,
    content that is not text)."""
    if not isinstance(messages, list) or not messages:
        return None
    out = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            return None
        text = message_text(message.get("content"))
        if text is None:
            return None
        out.append({"role": message["role"], "content": text})
    return out
