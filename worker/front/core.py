"""The one front core: everything a front does between its wire format and the engine, written once.

Every front (the gRPC servicer, the OpenAI app, and through them the cluster ingress) maps its wire to plain values
(worker/front/validation.py's PromptInput, SamplingValues, a constraint's (kind, text)) and calls `FrontCore`:

    core = FrontCore(Authenticator(tokens), metrics)        # made at start-up, before the model is loaded
    core.attach(engine, facts)                              # once the engine is warmed up (any EngineLike host)
    tenant = core.tenant(credentials)                       # Refusal(UNAUTHENTICATED) for a bad token
    stream = await core.admit(tenant, request_id, prompt, values, constraint)   # -> EngineStream, or Refusal
    ids, text = await core.tokenize(prompt); await core.pin(tenant, prompt, ttl); core.abort(tenant, request_id)

`admit` runs each rule once, in this order, so nothing is sized or allocated before it is known to be valid: the
cheap checks (request id, prompt shape and sizes, sampling values, the constraint's JSON: worker/front/validation.py),
tokenizing and chat templating in a worker thread, constraint compiling in a worker thread, then the engine's submit,
where the engine's own rules run (the prompt's length and ids, stop token ids, room in the context and the KV pool:
worker/engine/checks.py). Every failure is one `Refusal` whose `kind` each front maps to its own status and error
shape (gRPC status; HTTP status and OpenAI / Anthropic error body); its message names the field, and its `field` (a
FieldPath, from the rule that refused) is what each front renames to its own API's names with a table.

Request ids: the engine's id is `engine_request_id(tenant, request_id)`, so two tenants never collide and one
tenant can abort only its own requests; each host refuses a live id (DuplicateRequestError -> ALREADY_EXISTS).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from radixcache.cache import PinBudgetError
from radixcache.explain import Explanation
from radixcache.worker.engine.api import (
    DuplicateRequestError,
    EngineLike,
    EngineStats,
    EngineStoppedError,
    ModelFacts,
    RequestTooLargeError,
)
from radixcache.worker.engine.field_errors import CONSTRAINT, PROMPT, ContextOverflow, FieldPath, InvalidArgument
from radixcache.worker.engine.request import ErrorKind, FinishReason, Request, SamplingParams
from radixcache.worker.engine.stream import EngineStream, engine_request_id
from radixcache.worker.engine.structured import ConstraintError
from radixcache.worker.front.auth import Authenticator
from radixcache.worker.front.generated import GeneratedTokens
from radixcache.worker.front.validation import (
    CheckedPrompt,
    ModelLimits,
    PromptInput,
    PromptSize,
    SamplingValues,
    chat_renderer,
    check_cache_key,
    check_prompt_ids,
    check_prompt_input,
    check_prompt_size,
    check_request_id,
    check_ttl,
    constraint,
    fit_max_tokens,
    render_chat,
    render_off_loop,
    sampling_params,
)

log = logging.getLogger("radixcache.front")


class RefusalKind(enum.Enum):
    """Why a call was refused; each front maps a kind to its wire (gRPC status / HTTP status and error type)."""

    INVALID_ARGUMENT = "invalid_argument"  # a field out of range, named in the message and by Refusal.field
    CONTEXT_OVERFLOW = "context_overflow"  # an INVALID_ARGUMENT: the prompt (+ max_tokens) exceeds the context
    UNAUTHENTICATED = "unauthenticated"  # missing or unknown token
    PERMISSION_DENIED = "permission_denied"  # a valid token without the right (cache events need an admin)
    UNAVAILABLE = "unavailable"  # loading, draining, stopped, or (mid-stream) the serving replica went away
    TOO_LARGE = "too_large"  # can never fit in the KV pool
    ALREADY_EXISTS = "already_exists"  # the request id is live
    PIN_BUDGET = "pin_budget"  # a pin past the pin budget or into pages live requests were promised
    NO_CAPACITY = "no_capacity"  # (mid-stream) the request cannot fit beside pins
    INTERNAL = "internal"  # a failure inside the worker while serving this one request


# How a request that ended with FinishReason.ERROR is reported, by the engine's ErrorKind.
ERROR_KINDS = {
    ErrorKind.INTERNAL: RefusalKind.INTERNAL,
    ErrorKind.NO_CAPACITY: RefusalKind.NO_CAPACITY,
    ErrorKind.UNAVAILABLE: RefusalKind.UNAVAILABLE,
    ErrorKind.CONSTRAINT: RefusalKind.INVALID_ARGUMENT,  # the client's grammar hit a limit: its request, not ours
    None: RefusalKind.INTERNAL,
}


class Refusal(Exception):
    """A call the core refused. `field`: the part of the request it is about, as the rule that refused named it (a
    FieldPath in the engine's names: messages[0].content, max_tokens, PROMPT, json_schema, CONSTRAINT, ...; None:
    the call as a whole), which each front renames with its own table. `cause`: the validation error behind it,
    where there is one (a ContextOverflow's exact figures; the message's wording apart from the field's name)."""

    def __init__(
        self,
        kind: RefusalKind,
        message: str,
        *,
        field: FieldPath | None = None,
        cause: InvalidArgument | None = None,
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.field, self.cause = kind, message, field, cause

    @classmethod
    def of_failure(cls, error_kind: ErrorKind | None, message: str) -> Refusal:
        """A request that failed after it was admitted (its last output has FinishReason.ERROR)."""
        return cls(ERROR_KINDS[error_kind], message, field=CONSTRAINT if error_kind is ErrorKind.CONSTRAINT else None)

    @classmethod
    def of_invalid(cls, e: InvalidArgument) -> Refusal:
        """A rule's refusal: CONTEXT_OVERFLOW or INVALID_ARGUMENT, with the rule's field."""
        kind = RefusalKind.CONTEXT_OVERFLOW if isinstance(e, ContextOverflow) else RefusalKind.INVALID_ARGUMENT
        return cls(kind, str(e), field=e.field, cause=e)

    def worded(self, name: str) -> str:
        """The message with its field called `name` (a front's own name for it), where the message begins with the
        field's name; else the message as it is."""
        return self.cause.worded(name) if self.cause is not None else self.message


class FrontCore:
    """The state every front shares (one per worker, or per cluster ingress): the engine once attached, the model
    facts and validation limits, auth, metrics, and whether the worker is draining."""

    def __init__(
        self, auth: Authenticator | None = None, metrics: Any = None, memory: GeneratedTokens | None = None
    ) -> None:
        self.auth = auth or Authenticator()
        self.metrics = metrics  # WorkerMetrics: every output of every admitted request is observed
        # The token ids of what was generated, per tenant (worker/front/generated.py): a history that sends a reply back
        # continues from the model's own tokens.
        self.memory = GeneratedTokens() if memory is None else memory
        self.engine: EngineLike | None = None
        self.facts = ModelFacts()
        self.limits = ModelLimits(vocab_size=0, context_length=0)
        self.draining = False
        self.events: Any = None  # the engine's CacheEventHub (worker/events/hub.py), where the host has one

    def attach(self, engine: EngineLike, facts: ModelFacts) -> None:
        """Serve `engine` (started and warmed up): from now on calls are admitted."""
        self.facts = facts
        self.limits = ModelLimits.of(engine.tokenizer, vocab_size=facts.vocab_size, context_length=facts.context_length)
        self.engine = engine

    # -- gates -----------------------------------------------------------------------------------------------
    @property
    def serving(self) -> bool:
        return self.engine is not None and not self.draining

    def tenant(self, credentials: Iterable[tuple[str, str | bytes]] | None) -> str:
        """The caller's tenant (its cache namespace) from its `authorization: Bearer` credentials."""
        tenant = self.auth.tenant(credentials)
        if tenant is None:
            raise Refusal(RefusalKind.UNAUTHENTICATED, "missing or unknown bearer token")
        return tenant

    def require_admin(self, credentials: Iterable[tuple[str, str | bytes]] | None, what: str) -> None:
        """Refusal(PERMISSION_DENIED) unless the caller's token is marked admin; `what` names the call ("cache
        events")."""
        if not self.auth.is_admin(credentials):
            raise Refusal(RefusalKind.PERMISSION_DENIED, f"{what} need a token marked admin")

    def ready(self) -> EngineLike:
        """The engine, or Refusal(UNAVAILABLE) while loading or draining."""
        if self.draining:
            raise Refusal(RefusalKind.UNAVAILABLE, "the worker is shutting down")
        if self.engine is None:
            raise Refusal(RefusalKind.UNAVAILABLE, "the worker is still loading its model")
        return self.engine

    # -- generation ------------------------------------------------------------------------------------------
    async def admit(
        self,
        tenant: str,
        request_id: str | None,
        prompt: PromptInput | CheckedPrompt,
        values: SamplingValues,
        wanted: tuple[str | None, str] = (None, ""),
        *,
        fill_max_tokens: bool = False,
        cache_key: str = "",
        remember: bool | None = None,
    ) -> EngineStream:
        """Validate, tokenize, compile the constraint and submit: an open EngineStream (close it in a finally);
        its `prompt_text` is the rendered prompt ("" for token ids).

        prompt: as sent, or already checked (check_prompt). request_id None: a fresh one. wanted: the
        structured-output constraint as (kind, text) (see validation.constraint). fill_max_tokens: an unset
        max_tokens means as long as the reply can be (OpenAI chat's default: what the context and the KV pool
        leave), instead of validation's default. cache_key: the routing hint of Request.cache_key. Chat histories are
        tokenized with the tenant's remembered replies; remember: whether the finished samples are remembered (None:
        for chat prompts, the only ones a reply comes back in; a front that turned a conversation into token ids
        says True).
        """
        engine = self.ready()
        request_id = request_id or uuid.uuid4().hex
        try:  # the front's rules, each once; the engine's run at submit (stream.open)
            check_request_id(request_id)
            check_cache_key(cache_key)
            checked = (  # before tokenizing: bad shapes and sizes
                prompt
                if isinstance(prompt, CheckedPrompt)
                else check_prompt_input(prompt, engine.tokenizer, self.limits)
            )
            sampling = sampling_params(values, self.limits)  # and bad sampling values
            wanted_constraint = constraint(*wanted)
            messages = checked.prompt.messages if checked.kind == "messages" else None
            replies = self.memory.lookup(tenant, messages) if messages is not None else {}
            ids, text = await render_off_loop(checked, engine.tokenizer, replies)
            up_to = (self.facts.kv_tokens or self.facts.context_length) if fill_max_tokens else None
            sampling = fit_max_tokens(sampling, values, len(ids), self.limits, up_to=up_to)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None
        if wanted_constraint is not None:  # compiled (and cached) in a worker thread: the loop keeps serving
            try:
                await asyncio.to_thread(engine.compile_constraint, wanted_constraint)
            except ConstraintError as e:
                where = FieldPath.of(wanted_constraint.kind)
                raise Refusal(RefusalKind.INVALID_ARGUMENT, str(e), field=where) from None
        try:
            request = Request(
                engine_request_id(tenant, request_id), ids, sampling, namespace=tenant, constraint=wanted_constraint,
                cache_key=cache_key,
            )  # fmt: skip
        except ValueError as e:  # Request's own rule: a prompt of no tokens (a text the tokenizer encodes to nothing)
            raise Refusal(RefusalKind.INVALID_ARGUMENT, str(e), field=PROMPT) from None
        remembering = (
            self._remembering(engine, tenant, sampling)
            if (remember is None and checked.kind == "messages") or remember
            else None
        )
        stream = self._open(engine, request, request_id, remembering)
        stream.prompt_text = text
        return stream

    def _remembering(
        self, engine: EngineLike, tenant: str, sampling: SamplingParams
    ) -> Callable[[int, list[int], FinishReason], None] | None:
        """EngineStream.on_finished that remembers each finished sample's ids (its stop token dropped)."""
        tokenizer = engine.tokenizer
        if tokenizer is None or not self.memory.enabled:
            return None
        stops = set(getattr(tokenizer, "eos_token_ids", ())) | set(sampling.stop_token_ids)

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=False))

        def remember(index: int, ids: list[int], finish: FinishReason) -> None:
            if finish in (FinishReason.ERROR, FinishReason.ABORTED):
                return
            if finish is FinishReason.STOP_TOKEN and ids and ids[-1] in stops:
                ids = ids[:-1]
            self.memory.remember(tenant, ids, decode)

        return remember

    def _open(
        self,
        engine: EngineLike,
        request: Request,
        request_id: str,
        on_finished: Callable[[int, list[int], FinishReason], None] | None = None,
    ) -> EngineStream:
        """EngineStream.open(), with the host's synchronous refusals as Refusals (request_id: the caller's)."""
        stream = EngineStream(engine, request, self.metrics, on_finished)
        try:
            stream.open()
        except RequestTooLargeError as e:
            raise Refusal(RefusalKind.TOO_LARGE, str(e), field=PROMPT) from None
        except DuplicateRequestError:  # e.g. retried with the same id before the cancelled run wound down
            raise Refusal(RefusalKind.ALREADY_EXISTS, f"request_id {request_id!r} is already running") from None
        except InvalidArgument as e:  # the engine's own rules (worker/engine/checks.py)
            raise Refusal.of_invalid(e) from None
        except ValueError as e:
            raise Refusal(RefusalKind.INVALID_ARGUMENT, str(e)) from None
        except (EngineStoppedError, RuntimeError) as e:  # draining or stopped
            raise Refusal(RefusalKind.UNAVAILABLE, f"the worker is not accepting requests: {e}") from None
        return stream

    def abort(self, tenant: str, request_id: str) -> bool:
        """End the caller's own running request; False if it has none of that id."""
        return bool(self.ready().abort(engine_request_id(tenant, request_id)))

    def check_prompt_size(self, size: PromptSize) -> None:
        """Refuses (Refusal) a prompt that check_prompt_input would refuse by its size alone, from the size a front
        read before parsing the request; see validation.check_prompt_size."""
        self.ready()
        try:
            check_prompt_size(size, self.limits)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None

    def check_prompt(self, prompt: PromptInput) -> CheckedPrompt:
        """The prompt's cheap checks (validation.check_prompt_input), Refusal otherwise: for a front that reads a
        prompt before admitting it (continue_from) and hands the CheckedPrompt to `admit`, which then checks nothing
        twice."""
        try:
            return check_prompt_input(prompt, self.ready().tokenizer, self.limits)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None

    # -- the other calls -------------------------------------------------------------------------------------
    async def tokenize(
        self, prompt: PromptInput, *, fit: bool = False, tenant: str | None = None, **options: bool
    ) -> tuple[list[int], str]:
        """The prompt's token ids and rendered text, tokenized off the loop. Nothing is submitted, so the engine's
        prompt rules run here (validation.check_prompt_ids): token ids sent in the vocabulary, and with fit, room
        left to generate. tenant: a chat history is tokenized with that tenant's remembered replies, as `admit`
        tokenizes it (the ids are the ones admit would submit). options: validation.render's add_special_tokens and
        add_generation_prompt (both true by default, as admit renders)."""
        engine = self.ready()
        checked = self.check_prompt(prompt)
        try:
            messages = prompt.messages if checked.kind == "messages" else None
            replies = self.memory.lookup(tenant, messages) if tenant is not None and messages is not None else {}
            ids, text = await render_off_loop(checked, engine.tokenizer, replies, **options)
            check_prompt_ids(checked, ids, self.limits, fit=fit)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None
        return ids, text

    async def continue_from(
        self, prefixes: list[tuple[list[int], str]], prompt: CheckedPrompt
    ) -> tuple[list[int], str] | None:
        """The token ids of a chat prompt that extends a stored conversation, from the stored ids themselves: the
        prompt is rendered (a few jinja milliseconds at most) and, when its text begins with one of `prefixes`'
        texts, only the rest is tokenized and put after that prefix's ids. None when none is a prefix (the
        template wrote the history otherwise, or the instructions or tools changed): tokenize the prompt then.
        Returns (ids, rendered text). In a worker thread, like every tokenizing. `prompt`: checked (check_prompt),
        so that the admission that follows, with these ids or with the prompt itself, checks it only once."""
        engine = self.ready()
        tokenizer = engine.tokenizer

        def extend() -> tuple[list[int], str] | None:
            messages, render = chat_renderer(prompt, tokenizer)
            rendered = render_chat(render, messages)
            for ids, text in prefixes:
                if ids and rendered.startswith(text):
                    rest = rendered[len(text) :]
                    return ids + (list(tokenizer.encode(rest, add_special_tokens=False)) if rest else []), rendered
            return None

        try:
            return await asyncio.to_thread(extend)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None

    def stats_view(self, credentials: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """Whose figures a caller sees: a tenant its own (with the pool's capacity), an admin, or anyone with auth
        off, the whole worker's (None). Refusal(UNAUTHENTICATED) for a bad token."""
        return None if self.auth.is_admin(credentials) else self.tenant(credentials)

    async def stats(self, namespace: str | None = None) -> EngineStats:
        """The whole worker's figures, or (namespace) one tenant's: see Engine.stats and stats_view."""
        return await asyncio.to_thread(self.ready().stats, namespace)

    async def flush(self, tenant: str) -> int:
        """Drop the caller's own cached pages (one tenant cannot empty another's cache), and its remembered replies."""
        self.memory.clear(tenant)
        return int(await asyncio.to_thread(self.ready().flush_cache, tenant))

    async def retain(self, tenant: str, token_ids: list[int], ttl_s: float) -> int:
        """Pin what a finished request computed (its prompt and reply, `token_ids`) for ttl_s inside the pin budget,
        so a follow-up hits even under pressure (stored responses, prompt_cache_retention). Best effort: past the
        budget nothing is pinned (logged); returns the tokens pinned."""
        try:
            pinned, _ = await self.pin(tenant, PromptInput(token_ids=token_ids), ttl_s)
        except Refusal as r:
            log.info("not pinned (%s): %s", r.kind.value, r.message)
            return 0
        return pinned

    async def pin(self, tenant: str, prompt: PromptInput, ttl_s: float | None) -> tuple[int, int]:
        """Pin the prompt's cached whole pages for ttl_s (None: until unpinned), computing it first where it is not
        cached. Returns (tokens pinned, prompt tokens). Refusal(PIN_BUDGET) past the pin budget."""
        engine = self.ready()
        try:
            check_ttl(ttl_s)
        except InvalidArgument as e:
            raise Refusal.of_invalid(e) from None
        ids, _ = await self.tokenize(prompt, fit=True)
        whole = len(ids) // engine.page_size * engine.page_size
        try:
            pinned = int(await asyncio.to_thread(engine.pin, ids, tenant, ttl_s))
            if pinned < whole:  # not cached (yet): compute it with a one-token generation, then pin what it stored
                await self._compute(engine, tenant, ids)
                pinned = int(await asyncio.to_thread(engine.pin, ids, tenant, ttl_s))
        except PinBudgetError as e:
            raise Refusal(RefusalKind.PIN_BUDGET, str(e)) from None
        return pinned, len(ids)

    async def _compute(self, engine: EngineLike, tenant: str, ids: list[int]) -> None:
        request_id = "pin-" + uuid.uuid4().hex
        request = Request(engine_request_id(tenant, request_id), ids, SamplingParams(max_tokens=1), namespace=tenant)
        stream = self._open(engine, request, request_id)
        try:
            async for out in stream:
                if out.finish_reason is FinishReason.ERROR:
                    raise Refusal.of_failure(out.error_kind, f"computing the prefix failed: {out.error}")
        finally:
            stream.close()

    async def explain(self, tenant: str, prompt: PromptInput) -> Explanation:
        """The caller's own namespace's page-by-page view of the prompt, tokenized as `admit` would (a chat with the
        tenant's remembered replies): what a Generate of it would be served now and why no more. Changes nothing.
        A tenant only ever sees its own namespace: the namespace is the caller's tenant, never a field."""
        engine = self.ready()
        ids, _ = await self.tokenize(prompt, tenant=tenant)
        return await asyncio.to_thread(engine.explain, ids, tenant)

    async def unpin(self, tenant: str, prompt: PromptInput) -> int:
        engine = self.ready()
        ids, _ = await self.tokenize(prompt, fit=True)
        return int(await asyncio.to_thread(engine.unpin, ids, tenant))
