"""Request pricing: validate a body and price it in tokens and blocks.

A request that can never be served as sent raises :class:`guard.errors.PricingError`.

Prompt tokens are counted exactly for token-id prompts, with the injected tokenizer (a callable
``text -> int``) when there is one, else estimated as ``ceil(chars / chars_per_token)`` where
chars-per-token calibrates itself from the upstream's reported ``usage.prompt_tokens``. A chat
prompt adds an estimated template overhead per message, except where the precise prefix view
renders it with the replicas' chat template (``chat_template``): then it is counted exactly,
as the ids the view hashes.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from guard.config import GuardConfig, TenantConfig
from guard.errors import PricingError
from guard.replicas.prefix_cache import PrefixCacheView
from guard.request.cache_salt import CacheSalter
from guard.request.deadline import SDK_TIMEOUT_HEADER, client_timeout_s
from guard.request.idempotency_keys import IdempotencyKeys
from guard.request.output_lengths import OutputLengths
from guard.request.retry_headers import RETRY_COUNT_HEADERS, is_retry_attempt
from guard.request.rules import (
    ReplicaRules,
    chat_texts,
    check_common,
    completion_prompt,
    optional_int,
    parse_body,
    response_input_texts,
)
from policies.client_patience import client_software
from policies.cost import RequestClass, RequestCost

__all__ = [
    "PRICED_PATHS",
    "PricedRequest",
    "Pricer",
    "tokenizer_counter",
    "tokenizer_ids",
]

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
EMBEDDINGS_PATH = "/v1/embeddings"  # priced by its input tokens, nothing generated
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API: ``input`` items, ``max_output_tokens``
PRICED_PATHS = frozenset({COMPLETIONS_PATH, CHAT_PATH, EMBEDDINGS_PATH, RESPONSES_PATH})
CHAT_TOKENS_PER_MESSAGE = 4  # role and template markers around each message (estimate)
CHAT_TOKENS_PER_REPLY = 3  # the assistant header that primes the reply (estimate)
ESTIMATE_TOLERANCE_RATIO = 0.10  # an estimated prompt is rejected only if 10 % over the context
MIN_CHARS_PER_TOKEN, MAX_CHARS_PER_TOKEN = 1.0, 8.0
CALIBRATION_DECAY = 0.02  # weight of each new usage observation in the decayed sums
CALIBRATION_PRIOR_TOKENS = 200.0  # the initial ratio counts as this many observed tokens
_RETRY_COUNT_NAMES = frozenset(name for name, _ in RETRY_COUNT_HEADERS)
MIN_OUTPUT_SAMPLES = 8  # endings of a class before its learned output length is used


def _num_choices(priced: PricedRequest) -> int:
    n = priced.body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def tokenizer_counter(path: str) -> Callable[[str], int]:
    """A prompt-token counter from a ``tokenizer.json`` (the ``tokenizers`` package, no torch)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def tokenizer_ids(path: str) -> Callable[[str], list[int]]:
    """Prompt token ids from a ``tokenizer.json`` (the precise prefix-cache view hashes them)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


# Built for every request: slotted, not frozen (a frozen __init__ sets each field through
# object.__setattr__; docs/benchmarks.md §2). Never mutated after construction.
@dataclass(slots=True)
class PricedRequest:
    """A priced request plus what the middleware needs to forward it and learn from it."""

    cost: RequestCost
    body: dict
    is_stream: bool
    num_prompt_chars: int  # characters of prompt text (0 for token-id prompts)
    num_overhead_tokens: int  # estimated chat-template tokens included in the prompt count
    is_exact: bool  # prompt tokens counted (token ids or tokenizer), not estimated
    max_tokens_defaulted: bool  # the client sent no max_tokens; cost.max_tokens is the guard's
    raw: bytes = b""  # the body as the client sent it
    cache_salt: str | None = None  # the tenant's salt the guard adds (prefix cache isolation)
    responses: bool = False  # a /v1/responses request (its stream ends without [DONE])

    def forward_body(self) -> bytes:
        """The body to send upstream: as sent, or with the priced ``max_tokens`` filled in when
        the client sent none and the tenant's ``cache_salt`` set when the guard isolates
        tenants, so the replica runs exactly what the guard priced."""
        if not self.max_tokens_defaulted and self.cache_salt is None and self.raw:
            return self.raw
        body = dict(self.body)
        if self.max_tokens_defaulted:
            body["max_output_tokens" if self.responses else "max_tokens"] = self.cost.max_tokens
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        return json.dumps(body).encode()


class Pricer:
    """Prices requests; learns chars-per-token and expected output length per class online."""

    def __init__(self, config: GuardConfig, tokenizer: Callable[[str], int] | None = None,
                 prefix_view: PrefixCacheView | None = None):
        self._config = config
        self._tokenizer = tokenizer
        # the replicas' prefix caches as the guard sees them (None: priced as if all cold)
        self.prefix_view = prefix_view
        secret = config.prefix_cache_secret
        self._salter = CacheSalter(config.prefix_cache_isolation,
                                   secret.encode() if secret else None)
        cpt = config.initial_chars_per_token
        self._chars_sum = cpt * CALIBRATION_PRIOR_TOKENS
        self._tokens_sum = CALIBRATION_PRIOR_TOKENS
        self._chars_per_token = cpt
        self._outputs: dict[str, OutputLengths] = {}  # class -> its recent endings
        self._recent_keys = IdempotencyKeys(config.idempotency_ttl_s, config.max_idempotency_bytes)
        self._deadline_headers = frozenset({SDK_TIMEOUT_HEADER, config.deadline_header})

    # --- learning ---------------------------------------------------------------------------

    @property
    def chars_per_token(self) -> float:
        return self._chars_per_token

    def observe_usage(self, num_prompt_chars: int, num_prompt_tokens: int,
                      num_overhead_tokens: int = 0) -> None:
        """The upstream reported ``num_prompt_tokens`` for a prompt of ``num_prompt_chars``."""
        num_text_tokens = num_prompt_tokens - num_overhead_tokens
        if num_prompt_chars <= 0 or num_text_tokens <= 0:
            return
        keep = 1.0 - CALIBRATION_DECAY
        self._chars_sum = self._chars_sum * keep + num_prompt_chars
        self._tokens_sum = self._tokens_sum * keep + num_text_tokens
        ratio = self._chars_sum / self._tokens_sum
        self._chars_per_token = min(MAX_CHARS_PER_TOKEN, max(MIN_CHARS_PER_TOKEN, ratio))

    def observe_output(self, class_name: str, num_output_tokens: int,
                       max_tokens: int | None = None, *, censored: bool = False,
                       now_s: float | None = None) -> None:
        """A request of ``class_name`` ended with ``num_output_tokens`` generated per choice:
        censored (only a lower bound on its natural length) when it reached ``max_tokens`` or
        when ``censored`` says so (the stream was left early). See
        :mod:`guard.request.output_lengths`."""
        learned = self._outputs.get(class_name)
        if learned is None:
            learned = self._outputs[class_name] = OutputLengths()
        learned.observe(num_output_tokens, censored or (
            max_tokens is not None and num_output_tokens >= max_tokens), now_s)

    def observe_completion(self, priced: PricedRequest, num_prompt_tokens: int | None,
                           num_output_tokens: int | None, now_s: float | None = None) -> None:
        """Learn from a completed request's upstream ``usage`` (either count may be unknown);
        ``now_s``: when it ended (the output-length table is then rebuilt here when due)."""
        if num_prompt_tokens is not None and not priced.is_exact:
            self.observe_usage(priced.num_prompt_chars, num_prompt_tokens,
                               priced.num_overhead_tokens)
        if num_output_tokens is not None:
            cost = priced.cost
            self.observe_output(cost.request_class.name, num_output_tokens // _num_choices(priced),
                                cost.max_tokens, now_s=now_s)

    def observe_abandoned(self, priced: PricedRequest, num_output_tokens: int,
                          now_s: float | None = None) -> None:
        """A stream that ended early (the client left, the upstream failed) after
        ``num_output_tokens``: its request would have run at least that long."""
        self.observe_output(priced.cost.request_class.name,
                            num_output_tokens // _num_choices(priced), censored=True, now_s=now_s)

    def expected_output_tokens(self, class_name: str, max_tokens: int,
                               now_s: float | None = None) -> int:
        """``max_tokens`` until the class has ``MIN_OUTPUT_SAMPLES`` endings (KV cost is never
        underestimated before anything is learned), then E[min(length, max_tokens)] from its
        recent endings, censored ones counted as lower bounds (:mod:`guard.request.output_lengths`)."""
        learned = self._outputs.get(class_name)
        if learned is None or learned.num_fresh < MIN_OUTPUT_SAMPLES:
            return max_tokens
        return learned.expected(max_tokens, now_s)  # now_s: when the table may be rebuilt

    def observe_preemptions(self, num_new: int) -> None:
        """A replica preempted ``num_new`` sequences: the learned output lengths let the guard
        admit more than fits, so every class goes back to ``max_tokens`` until it has
        ``MIN_OUTPUT_SAMPLES`` fresh endings (what was learned is kept as their start)."""
        if num_new > 0:
            for learned in self._outputs.values():
                learned.reset()

    # --- pricing ----------------------------------------------------------------------------

    def price(self, body: dict | bytes, path: str, headers: Mapping[str, str],
              tenant: TenantConfig, now_s: float, *, max_model_len: int | None,
              block_size: int, request_id: str | None = None) -> RequestCost:
        """The request's cost, or PricingError when it can never be served as sent."""
        return self.price_request(body, path, headers, tenant, now_s, max_model_len=max_model_len,
                                  block_size=block_size, request_id=request_id).cost

    def price_request(self, body: dict | bytes, path: str, headers: Mapping[str, str],
                      tenant: TenantConfig, now_s: float, *, max_model_len: int | None = None,
                      block_size: int = 16, request_id: str | None = None,
                      rules: ReplicaRules | None = None,
                      model_rules: Callable[[object], ReplicaRules] | None = None
                      ) -> PricedRequest:
        """Like :meth:`price`, with the parsed body and the counts the middleware learns from.

        ``headers`` has lower-case names (see :func:`guard.request.body.headers_from_scope`);
        ``rules`` (when given) replaces ``max_model_len`` and ``block_size``; ``model_rules``
        (when given) replaces both by the rules for the body's ``model`` (its own context).
        """
        data = parse_body(body)
        if model_rules is not None:
            rules = model_rules(data.get("model"))
        elif rules is None:
            rules = ReplicaRules(max_model_len, block_size)
        max_model_len, block_size = rules.max_model_len, rules.block_size
        n = check_common(data, rules)
        chars, tokens, overhead, exact = self._count_prompt(data, path, rules)
        view = self.prefix_view
        chat_ids = None
        if view is not None and view.mode == "precise" and path.endswith(CHAT_PATH):
            # the prompt the replicas' chat template renders: its exact count when it renders
            chat_ids = view.chat_token_ids(data)
            if chat_ids:
                tokens, overhead, exact = len(chat_ids), 0, True
        responses = path.endswith(RESPONSES_PATH)
        embeddings = not responses and path.endswith(EMBEDDINGS_PATH)
        if embeddings:  # one forward pass, nothing generated: one step
            max_tokens, defaulted = 1, False
        else:
            max_tokens, defaulted = self._max_tokens(data, tokens, exact, max_model_len,
                                                     responses)
        request_class = self._resolve_class(headers, tenant)
        engine_salt, added_salt = self._salter.salts(data, tenant.name)
        key = cached = None
        if view is not None and not embeddings and not responses:  # prompts it renders
            key = view.key(data, "messages" in data, tokens, self._chars_per_token, engine_salt,
                           headers.get("x-session-id"), chat_ids)
            cached = view.cached_tokens(key)
        cost = RequestCost(  # one per request, positional in field order
            request_id or uuid.uuid4().hex,
            tenant.name,
            request_class,
            tokens,                                                   # num_prompt_tokens
            max_tokens,
            n * self.expected_output_tokens(request_class.name, max_tokens, now_s),
            n * math.ceil((tokens + max_tokens) / block_size),        # num_blocks
            now_s,                                                    # arrival_s
            (self._deadline_s(headers, now_s, request_class.ttft_s)  # deadline_s
             if not self._deadline_headers.isdisjoint(headers)
             else now_s + request_class.ttft_s),  # no deadline hint: the class's
            self._is_retry(headers, tenant.name, now_s),              # is_retry
            client_software(headers.get("user-agent")),               # client
            cached,                                                   # cached_prefix_tokens
            key,                                                      # prefix_key
        )
        raw = body if isinstance(body, bytes) else b""
        return PricedRequest(cost, data, bool(data.get("stream")), chars, overhead, exact, defaulted,
                             raw, added_salt, responses)

    def _max_tokens(self, data: dict, num_prompt_tokens: int, exact: bool,
                    max_model_len: int | None, responses: bool = False) -> tuple[int, bool]:
        # max_completion_tokens is chat's (it wins there); completions read max_tokens only;
        # the Responses API names its limit max_output_tokens
        if responses:
            name = "max_output_tokens"
            requested = optional_int(data, name, 1)
        else:
            name = "max_completion_tokens"
            requested = optional_int(data, name, 1) if "messages" in data else None
            if requested is None:
                name = "max_tokens"
                requested = optional_int(data, name, 1)
        lower = num_prompt_tokens if exact else math.floor(num_prompt_tokens * (1 - ESTIMATE_TOLERANCE_RATIO))
        if requested is None:
            default = self._config.default_max_tokens
            if self._config.missing_max_tokens == "forward":  # sent untouched: the replica
                # may run to its context, so that bounds the reservation when it is known
                if max_model_len is not None and max_model_len - num_prompt_tokens >= 1:
                    return max_model_len - num_prompt_tokens, False
                return default, False
            if max_model_len is not None:  # the client asked for nothing: fit what is left
                default = min(default, max_model_len - num_prompt_tokens)
            if default >= 1:
                return default, True
            requested = 1
        if max_model_len is not None and lower + requested > max_model_len:
            raise PricingError(
                400, "context_length_exceeded",
                f"This model's maximum context length is {max_model_len} tokens; the request has "
                f"{'' if exact else 'about '}{num_prompt_tokens} prompt tokens plus "
                f"{requested} completion tokens", name)
        return requested, False

    def _count_prompt(self, data: dict, path: str,
                      rules: ReplicaRules) -> tuple[int, int, int, bool]:
        """(prompt chars, prompt tokens, chat overhead tokens, exact?)"""
        if path.endswith(COMPLETIONS_PATH) and not path.endswith(CHAT_PATH):
            return self._count_completion_prompt(data)
        if path.endswith(CHAT_PATH):
            texts = chat_texts(data, rules)
            overhead = CHAT_TOKENS_PER_MESSAGE * len(data["messages"]) + CHAT_TOKENS_PER_REPLY
            chars = sum(len(t) for t in texts)
            if self._tokenizer is not None:
                return chars, sum(self._tokenizer(t) for t in texts) + overhead, overhead, True
            return chars, self._estimate(chars) + overhead, overhead, False
        if path.endswith(EMBEDDINGS_PATH):
            return self._count_embedding_input(data)
        if path.endswith(RESPONSES_PATH):
            texts, num_items = response_input_texts(data)
            overhead = CHAT_TOKENS_PER_MESSAGE * num_items + CHAT_TOKENS_PER_REPLY
            chars = sum(len(t) for t in texts)
            if self._tokenizer is not None:
                return chars, sum(self._tokenizer(t) for t in texts) + overhead, overhead, True
            return chars, self._estimate(chars) + overhead, overhead, False
        raise PricingError(404, "unknown_endpoint", f"{path} is not a priced endpoint")

    def _count_embedding_input(self, data: dict) -> tuple[int, int, int, bool]:
        """``input``: a string, strings, token ids, or lists of token ids (OpenAI's shapes)."""
        items = data.get("input")
        if isinstance(items, str) or (isinstance(items, list) and items
                                      and all(isinstance(i, int) for i in items)):
            items = [items]
        if not isinstance(items, list) or not items:
            raise PricingError(400, "invalid_value", "'input' must be a string, an array of "
                               "strings, or token ids", "input")
        chars = tokens = 0
        exact = True
        for item in items:
            if isinstance(item, str):
                chars += len(item)
                if self._tokenizer is not None:
                    tokens += self._tokenizer(item)
                else:
                    tokens += self._estimate(len(item))
                    exact = False
            elif isinstance(item, list) and all(
                    isinstance(t, int) and not isinstance(t, bool) for t in item):
                tokens += len(item)
            else:
                raise PricingError(400, "invalid_value", "'input' must be a string, an array "
                                   "of strings, or token ids", "input")
        return chars, max(tokens, 1), 0, exact

    def _count_completion_prompt(self, data: dict) -> tuple[int, int, int, bool]:
        prompt = completion_prompt(data)
        if not isinstance(prompt, str):
            return 0, len(prompt), 0, True
        if self._tokenizer is not None:
            return len(prompt), self._tokenizer(prompt), 0, True
        return len(prompt), math.ceil(len(prompt) / self._chars_per_token), 0, False  # _estimate

    def _estimate(self, num_chars: int) -> int:
        return math.ceil(num_chars / self._chars_per_token)

    def _resolve_class(self, headers: Mapping[str, str], tenant: TenantConfig) -> RequestClass:
        name = tenant.default_class or self._config.default_class
        wanted = headers.get(self._config.class_header)
        if wanted is not None and tenant.may_choose_class:
            name = wanted.strip()
        request_class = self._config.request_class(name)
        if request_class is None:
            raise PricingError(400, "unknown_class", f"unknown request class {name!r}",
                               self._config.class_header)
        return request_class

    def _deadline_s(self, headers: Mapping[str, str], now_s: float, ttft_s: float) -> float:
        """The class's TTFT deadline, or the client's own when it is sooner."""
        timeout_s = client_timeout_s(headers, self._config.deadline_header)
        return now_s + (ttft_s if timeout_s is None else min(ttft_s, timeout_s))

    def _is_retry(self, headers: Mapping[str, str], tenant: str, now_s: float) -> bool:
        """A retry counter header (:mod:`guard.request.retry_headers`) or a repeated Idempotency-Key."""
        # a retry counter header is rare: is_retry_attempt only when one is there
        retry = not _RETRY_COUNT_NAMES.isdisjoint(headers) and is_retry_attempt(headers)
        key = headers.get("idempotency-key")
        if key:  # always record the key, so a later repeat is seen as a retry
            retry = self._recent_keys.seen(tenant, key, now_s) or retry
        return retry
