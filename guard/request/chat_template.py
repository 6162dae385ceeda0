"""The replicas' chat template, so the precise prefix view can price chat requests.

A kvguard engine hashes the token ids of the prompt its chat template renders; to match them,
the guard renders a chat request's messages with the same template, exactly as the engine does
(:mod:`serving.chat_template`, the one rendering both use), and encodes the text with the
engine's tokenizer (the guard's ``tokenizer`` key).

The ``chat_template`` key names either

* a ``tokenizer_config.json`` (a name ending in ``.json``): its ``chat_template`` (a string,
  or Hugging Face's list of named templates, of which ``default`` is used) and the
  ``bos_token`` / ``eos_token`` strings it names (a string or an ``{"content": ...}`` object);
* or a raw jinja template file, which must not use ``bos_token`` / ``eos_token`` (a raw file
  does not say what they are; give the ``tokenizer_config.json`` instead).

The file is read and the template compiled when the configuration is built: a missing file,
bad JSON, no template or one that does not compile is a ``ValueError`` naming the key.

A request the template cannot render as the replica would — a message the engine does not
render (an unknown role, content that is not text), request fields that change the rendering
(``tools``, ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message``, ``documents``), or a template that raises — gets ``None`` with the
reason: the view prices it as uncached (a different first block would match nothing anyway).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serving.chat_template import chat_messages, compile_chat_template, render_chat_template

__all__ = ["ChatTemplate", "load_chat_template"]

_KEY = "chat_template"
# request fields (vLLM's chat extensions, OpenAI's tools) that change what a replica renders;
# each with the values that change nothing
_RENDERING_FIELDS: dict[str, tuple] = {
    "tools": (None, []),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None, []),
}


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template with the special-token strings it is rendered with."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    path: str = ""
    _compiled: Any = field(default=None, repr=False, compare=False)

    def render(self, body: dict) -> tuple[str | None, str]:
        """(the prompt text the replica renders for this chat body, "") or (None, why not)."""
        for name, neutral in _RENDERING_FIELDS.items():
            if name in body and not any(body[name] == value and type(body[name]) is type(value)
                                        for value in neutral):
                return None, f"the request sets {name!r}, which changes the rendering"
        messages = chat_messages(body.get("messages"))
        if messages is None:
            return None, "a message the engine does not render (its role or its content)"
        try:
            text = render_chat_template(self._compiled, messages, bos_token=self.bos_token,
                                        eos_token=self.eos_token)
        except Exception as exc:  # noqa: BLE001 - raise_exception, jinja2 errors, sandbox
            return None, f"the template raised: {exc}"
        return text, ""


def load_chat_template(path: str) -> ChatTemplate:
    """The template ``path`` names (see the module docstring); ValueError naming the key."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ValueError(f"{_KEY}: cannot read {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{_KEY}: {path!r} is not UTF-8 text") from None
    if path.endswith(".json"):
        source, bos, eos = _from_tokenizer_config(path, text)
    else:
        source, bos, eos = text, "", ""
        if "bos_token" in source or "eos_token" in source:
            raise ValueError(f"{_KEY}: the raw template {path!r} uses bos_token/eos_token, "
                             "which a raw file does not define: give the model's "
                             "tokenizer_config.json instead")
    if not source.strip():
        raise ValueError(f"{_KEY}: {path!r} holds an empty template")
    try:
        compiled = compile_chat_template(source)
    except ImportError:
        raise ValueError(f"{_KEY}: rendering templates needs jinja2, which the guard installs "
                         "with its kv-events extra (pip install 'kvguard[kv-events]')") from None
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateSyntaxError and friends
        raise ValueError(f"{_KEY}: the template in {path!r} does not compile: {exc}") from None
    return ChatTemplate(source, bos, eos, path, compiled)


def _from_tokenizer_config(path: str, text: str) -> tuple[str, str, str]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{_KEY}: {path!r} is not valid JSON ({exc.msg}, line {exc.lineno})"
                         ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{_KEY}: {path!r} must hold a JSON object (a tokenizer_config.json)")
    source = data.get("chat_template")
    if isinstance(source, list):  # Hugging Face's named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        raise ValueError(f"{_KEY}: {path!r} has no chat_template string (nor a 'default' one)")
    return source, _token(path, data, "bos_token"), _token(path, data, "eos_token")


def _token(path: str, data: dict, name: str) -> str:
    value = data.get(name)
    if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
        value = value.get("content")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{_KEY}: {name} in {path!r} must be a string, got {value!r:.40}")
    return value
