"""How a schedule's prompts share tokens: the workloads prefix caches are judged by.

A workload rewrites a seeded schedule's requests (``build_schedule`` applies it last), giving
each request ``prompt_parts`` — seeded token runs that :func:`chaos.schedule.prompt_token_ids`
concatenates, the same key giving the same tokens wherever it appears — and, for
conversations, a ``session_id`` (sent as ``x-session-id``).

* ``unique`` (no workload): every prompt is its own random tokens; nothing is ever reused.
* :class:`SharedPrefix` (``--workload shared-prefix``): ``num_prefixes`` prefixes of
  ``prefix_tokens`` tokens (system prompts, few-shot templates, RAG preambles), each request
  one of them, drawn with Zipf popularity (prefix ``k`` has weight ``1 / (k + 1) ** zipf_s``;
  0 is uniform), followed by a unique question whose length is the schedule's prompt length.
* :class:`MultiTurn` (``--workload multi-turn``): ``num_sessions`` conversations open at
  once, each arrival the next turn of one of them (uniformly drawn); every turn resends the
  conversation so far — its system prompt (``system_tokens``), then each earlier turn's
  question and answer — plus its new question (the schedule's prompt length). The answers
  resent are the lengths the earlier turns asked for, in tokens of their own: the schedule is
  made before the run, so they are not the engine's actual words (an engine's cache holds
  the earlier prompts, not these answers: the reuse it can find is the conversation up to
  the last question, as with a client that rewrites history). A conversation ends after
  ``max_turns`` turns or when the next would pass ``max_prompt_tokens``, and a new one opens.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from dataclasses import dataclass
from typing import Protocol

from chaos.records import RequestSpec

__all__ = ["WORKLOADS", "MultiTurn", "SharedPrefix", "Workload", "add_workload_args",
           "make_workload", "workload_args", "workload_from_args"]

WORKLOADS = ("unique", "shared-prefix", "multi-turn")


class Workload(Protocol):
    name: str

    def apply(self, specs: list[RequestSpec], seed: int) -> list[RequestSpec]: ...


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class SharedPrefix:
    num_prefixes: int = 32
    prefix_tokens: int = 2000
    zipf_s: float = 1.0
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        _positive_int("num_prefixes", self.num_prefixes)
        _positive_int("prefix_tokens", self.prefix_tokens)
        if not 0.0 <= self.zipf_s <= 10.0:
            raise ValueError(f"zipf_s must be in [0, 10], got {self.zipf_s!r}")

    def weights(self) -> list[float]:
        return [1.0 / (k + 1) ** self.zipf_s for k in range(self.num_prefixes)]

    def apply(self, specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
        rng = random.Random(f"shared-prefix-{seed}")
        prefixes = rng.choices(range(self.num_prefixes), weights=self.weights(), k=len(specs))
        return [dataclasses.replace(
            s, num_prompt_tokens=self.prefix_tokens + s.num_prompt_tokens,
            prompt_parts=((f"prefix-{p}", self.prefix_tokens),
                          (f"question-{s.index}", s.num_prompt_tokens)))
            for s, p in zip(specs, prefixes, strict=True)]


@dataclass(frozen=True)
class MultiTurn:
    num_sessions: int = 16
    system_tokens: int = 500
    max_turns: int = 8
    max_prompt_tokens: int = 3500
    name: str = "multi-turn"

    def __post_init__(self) -> None:
        for name in ("num_sessions", "system_tokens", "max_turns", "max_prompt_tokens"):
            _positive_int(name, getattr(self, name))

    def apply(self, specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
        rng = random.Random(f"multi-turn-{seed}")
        # per open slot: (conversation number, its parts so far)
        slots: list[tuple[int, tuple[tuple[str, int], ...]]] = []
        next_conversation = 0
        out = []
        for spec in specs:
            slot = rng.randrange(self.num_sessions)
            while len(slots) <= slot:
                slots.append((next_conversation, ((f"system-{next_conversation}",
                                                   self.system_tokens),)))
                next_conversation += 1
            conversation, parts = slots[slot]
            turn = (len(parts) - 1) // 2
            question = (f"question-{conversation}-{turn}", spec.num_prompt_tokens)
            if turn >= self.max_turns or _tokens(parts) + question[1] > self.max_prompt_tokens:
                conversation, next_conversation = next_conversation, next_conversation + 1
                parts = ((f"system-{conversation}", self.system_tokens),)
                question = (f"question-{conversation}-0", spec.num_prompt_tokens)
            prompt = (*parts, question)
            out.append(dataclasses.replace(spec, num_prompt_tokens=_tokens(prompt),
                                           prompt_parts=prompt,
                                           session_id=f"conversation-{conversation}"))
            answer = (f"answer-{conversation}-{len(parts) // 2}", spec.max_tokens)
            slots[slot] = (conversation, (*prompt, answer))
        return out


def _tokens(parts: tuple[tuple[str, int], ...]) -> int:
    return sum(n for _, n in parts)


def make_workload(name: str, *, num_prefixes: int = 32, prefix_tokens: int = 2000,
                  zipf_s: float = 1.0, num_sessions: int = 16, system_tokens: int = 500,
                  max_turns: int = 8, max_prompt_tokens: int = 3500) -> Workload | None:
    """The workload called ``name`` (None for ``unique``); ValueError naming a bad value."""
    if name == "unique":
        return None
    if name == "shared-prefix":
        return SharedPrefix(num_prefixes, prefix_tokens, zipf_s)
    if name == "multi-turn":
        return MultiTurn(num_sessions, system_tokens, max_turns, max_prompt_tokens)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")


_FLAGS = (("--num-prefixes", "num_prefixes", int, 32, "shared-prefix: distinct prefixes"),
          ("--prefix-tokens", "prefix_tokens", int, 2000, "shared-prefix: tokens per prefix"),
          ("--zipf", "zipf_s", float, 1.0, "shared-prefix: Zipf exponent of prefix popularity"),
          ("--sessions", "num_sessions", int, 16, "multi-turn: conversations open at once"),
          ("--system-tokens", "system_tokens", int, 500, "multi-turn: system prompt tokens"),
          ("--max-turns", "max_turns", int, 8, "multi-turn: turns per conversation"),
          ("--max-conversation-tokens", "max_prompt_tokens", int, 3500,
           "multi-turn: a conversation past this many prompt tokens starts over"))


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """``--workload`` and its parameters (``--prompt-tokens`` is then the question length)."""
    p.add_argument("--workload", choices=WORKLOADS, default="unique",
                   help="how prompts share tokens (see chaos.workloads); with shared-prefix "
                        "and multi-turn --prompt-tokens is each new question's length")
    for flag, dest, kind, default, help_text in _FLAGS:
        p.add_argument(flag, dest=dest, type=kind, default=default, help=help_text)


def workload_from_args(args: argparse.Namespace) -> Workload | None:
    return make_workload(getattr(args, "workload", "unique"),
                         **{dest: getattr(args, dest) for _, dest, *_ in _FLAGS
                            if hasattr(args, dest)})


def workload_args(args: argparse.Namespace) -> list[str]:
    """The flags that rebuild ``args``' workload on another command line."""
    if getattr(args, "workload", "unique") == "unique":
        return []
    out = ["--workload", args.workload]
    for flag, dest, *_ in _FLAGS:
        out += [flag, repr(getattr(args, dest))]
    return out
