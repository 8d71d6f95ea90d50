"""Admission: the one place an inference request passes, in this order:

    key -> tenant -> scope -> limits -> bounds -> job -> token reserve -> queue

`tenant()` runs first, at the HTTP edge's guard, on the headers alone (a wrong
key is refused before anything reads the body); `admit()` runs once the body
names the model, as one call with no callback: the rest, in that order (for a
model routed by vLLM's own cache, the prompt's token ids are asked of a
runtime just before the queue), the job then waiting in its tenant's lane of
the model's fair queue (supervisor/scheduling/fair_queue.py).

The tenants, their keys, scopes and limits are supervisor/admission/tenants.py's table,
which a reload replaces; with no [[tenants]] there is one tenant, "default".
"""

from __future__ import annotations

import hmac
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from protocol import Done
from protocol.errors import ErrorCode, PoolError, context_message
from supervisor.scheduling.deadlines import NO_SLO, request_slo, unmeetable
from supervisor.scheduling.jobs import Admitted, Job
from supervisor.models.capabilities import CALLS, check_serves, forwarded_headers
from supervisor.models.views import served_context
from supervisor.shapes.openai import MAX_OUTPUT_TOKENS
from supervisor.admission.tenants import DEFAULT, Tenant, Tenants, TenantSpec

if TYPE_CHECKING:  # the composition root above: admission queues through it
    from supervisor.admission.fallback_chains import Chain
    from supervisor.engine import ModelRouterEngine

DEFAULT_TENANT = Tenant(TenantSpec(DEFAULT))  # who a request is when the edge did not say (no edge in front)
PROMPT_BYTES_PER_TOKEN = 4  # a prompt's tokens counted against tpm at admission, set right at its end
# the output a request may produce, reserved against tpm at admission: its own limit when it sets one...
OUTPUT_LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
DEFAULT_OUTPUT_RESERVE = 1024  # ...else this many tokens (the window's size when that is smaller)


def output_reserve(request: dict, context: int | None = None) -> int:
    """The output tokens a request may produce, as its tpm reserve counts them: its own limit,
    at most the model's `context` where its runtime reports it (the runtime stops there, so a
    limit above it is not refused: coding agents ask 32,000 of an 8,192 window). Over
    MAX_OUTPUT_TOKENS is a 400 naming the field: the shapes bound the fields they declare,
    this also the kin a body passes through."""
    reserve = None
    for name in OUTPUT_LIMIT_KEYS:
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            if value > MAX_OUTPUT_TOKENS:
                shown = value if value < 10**12 else "that"  # an echo of the client's input stays short
                raise PoolError(ErrorCode.INVALID_REQUEST, f"{name}: {shown} is over the most output tokens a "
                                f"request may ask for ({MAX_OUTPUT_TOKENS} tokens)", param=name)
            reserve = value if reserve is None else reserve
    reserve = DEFAULT_OUTPUT_RESERVE if reserve is None else reserve
    return min(reserve, context) if context else reserve


def presented_key(headers) -> bytes:
    """The key an ASGI request carries: `Authorization: Bearer <key>`, else `x-api-key`; b"" when none."""
    given = b""
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:]
        if name == b"x-api-key":
            given = value
    return given


def key_matches(given: bytes, wanted: list[bytes]) -> bool:
    """Constant time per key compared: how much of a key matches does not show in the timing."""
    matched = False
    for key in wanted:
        matched |= hmac.compare_digest(given, key)
    return matched


class Admission:
    """Key, tenant, scope and limits of inference requests, then the engine's queue."""

    def __init__(self, engine: ModelRouterEngine, tenants: Tenants,
                 max_held_bytes: Callable[[], int] = lambda: sys.maxsize) -> None:
        self.engine = engine
        self.tenants = tenants
        self.held_bytes = 0  # the frames of admitted requests not yet ended
        self.max_held_bytes = max_held_bytes  # server.max_held_request_bytes, as a reload leaves it

    # -- key -> tenant: at the edge, before the body is read -----------------------------------------------
    def tenant(self, headers) -> Tenant:
        """The tenant of a request with these ASGI headers: 401 `unauthorized` with no key
        (or a wrong one when there are no [[tenants]]), 401 `invalid_api_key` for a key no
        tenant holds."""
        tenants = self.tenants
        if tenants.open:
            return tenants.default()
        given = presented_key(headers)
        tenant = tenants.for_key(given)
        if tenant is None:
            if given and tenants.configured:
                raise PoolError(ErrorCode.INVALID_API_KEY, "incorrect API key provided")
            raise PoolError(ErrorCode.UNAUTHORIZED, "missing or wrong API key")
        return tenant

    # -- scope -> limits -> queue: once the body names the model -------------------------------------------
    def check_scope(self, tenant: Tenant, model: str):
        """The model's entry: 404 for a model that does not exist, and the same answer for one
        out of the tenant's scope: a tenant does not learn other tenants' models."""
        entry = self.engine.entry(model)
        if not tenant.spec.may_use((entry.cfg.name, *entry.cfg.aliases)):
            raise PoolError(ErrorCode.MODEL_NOT_FOUND, f"model {model!r} does not exist", param="model")
        return entry

    async def admit(self, tenant: Tenant, model: str, request: dict, endpoint: str, headers=None,
                    session: str | None = None, chain: Chain | None = None) -> Job:
        """The job for this request, queued on its model; PoolError when it is refused. One
        call, in this order: the model's name resolved once (Registry.lookup) and its scope →
        the output limit (400) → limits (429: rpm, max_inflight) → bounds and the job
        (engine.make_job) → the tpm reserve (the prompt's estimate and the most output it
        may produce; 429) → the prompt's token ids where routing needs them (a prompt they show
        to be over the model's context is refused here, as the runtime would) → the prediction
        against the request's deadlines (503 deadline_unmeetable; deadlines.py: `headers`
        carry x-slo-*) → the queue. What was counted is given back when a later step
        refuses; the reserve settles to the real usage at the job's end. What it decided is
        the job's `admitted` record (jobs.Admitted: this `Counted`); `chain`, the edge's
        fallback chain this model is tried in, bounds the job's deadline by its own."""
        entry = self.check_scope(tenant, model)
        context = served_context(entry)
        if endpoint in CALLS:  # the runtime's own calls: 400 where the model's backend has none; no output
            check_serves(entry.cfg, endpoint)
            output = 0
        else:
            output = output_reserve(request, context)  # 400 before it counts against any limit
        slo = request_slo(headers or {}, tenant.spec, entry.cfg)
        tenant.admit()
        counted = Counted(tenant, self, session, chain)
        try:
            job = self.engine.make_job(entry, request, endpoint, tenant.name,
                                       headers=forwarded_headers(endpoint, headers))
            job.admitted = counted  # what admission decides (below) is the job's record
            # whatever ends the job from here on (the queue, a deadline, a worker) settles what it holds
            job.on_end = counted.settle
            counted.hold(len(job.frame), self.max_held_bytes())
            counted.estimate = len(job.frame) // PROMPT_BYTES_PER_TOKEN
            counted.reserved = tenant.reserve_tokens(counted.estimate + output)
            asked = self.engine.prompt_tokens(entry, request, endpoint)  # None where routing needs none
            tokens = await asked if asked is not None else None
            if tokens is not None and context and len(tokens) > context:  # counted before sending
                raise PoolError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, context_message(len(tokens), context))
            counted.prompt_tokens = tokens
            counted.prediction = self.engine.predict(entry, tenant.name, len(job.frame))
            if slo is not NO_SLO:
                refused = unmeetable(entry.cfg.name, slo, counted.prediction)
                if refused is not None:
                    raise refused
                if slo.ttft_ms is not None:  # queued past it, the job leaves the queue (Job.expired)
                    counted.slo_ttft_ms = slo.ttft_ms
                    counted.slo_deadline = deadline = job.created_at + slo.ttft_ms / 1000
                    job.queue_deadline = min(job.queue_deadline or deadline, deadline)
            if chain is not None and chain.deadline is not None:  # one deadline for the whole chain
                job.deadline = min(job.deadline, chain.deadline)
            # the model's state, load_on_demand and shutdown are checked again there: an await above
            # (the prompt's tokens) may have changed them
            self.engine.enqueue(entry, job)
        except BaseException:  # refused (queue full, ...) or the client left: it used nothing
            counted.refuse()
            raise
        return job
    # -- what a tenant sees ------------------------------------------------------------------------------------
    def model_list(self, tenant: Tenant) -> list[dict]:
        """/v1/models for this tenant: only what it may use."""
        listed = self.engine.model_list()
        if tenant.spec.models == ("*",):
            return listed
        allowed = {name for name, e in self.engine.models.items() if tenant.spec.may_use((name, *e.cfg.aliases))}
        return [m for m in listed if m.get("alias_of", m["id"]) in allowed]

    def with_limit_headers(self, tenant: Tenant, send):
        """`send` that adds the tenant's x-ratelimit-* headers to the response's start (every
        answer: a success, a 429, any error); `send` itself for a tenant without limits."""
        if not tenant.limited:
            return send

        async def send_with_limits(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *tenant.limit_headers()]}
            await send(message)
        return send_with_limits


class Counted(Admitted):
    """One admitted request's book: what admission decided for its job (the job's `admitted`
    record: jobs.Admitted, written here alone), and what it holds of its tenant (a place in
    flight, its tpm reserve), given back exactly once: `settle` at the job's end, however it
    ends (attached before anything can end it), or `refuse` when admission refuses it after
    counting it."""

    __slots__ = ("tenant", "admission", "estimate", "reserved", "held", "open")

    def __init__(self, tenant: Tenant, admission: Admission, session: str | None, chain: Chain | None) -> None:
        # the record's fields (Admitted), set here rather than by a call of Admitted.__init__: one call
        # less on every request's path
        self.session, self.chain = session, chain
        self.prompt_tokens = self.prediction = self.slo_ttft_ms = self.slo_deadline = None
        self.tenant = tenant
        self.admission = admission
        self.estimate = 0  # the prompt's tokens as admission guessed them
        self.reserved = 0  # held of the tpm window
        self.held = 0  # of admission.held_bytes
        self.open = True

    def hold(self, size: int, limit: int) -> None:
        """Count the request's frame among what admitted requests hold: 429 past `limit`."""
        self.held = size
        self.admission.held_bytes += size
        if self.admission.held_bytes > limit:
            raise PoolError(ErrorCode.QUEUE_FULL, f"admitted requests hold {self.admission.held_bytes - size} "
                            f"bytes; this one's {size} would pass server.max_held_request_bytes ({limit}); "
                            f"retry shortly", retry_after_s=1)

    def refuse(self) -> None:
        """Refused on the way in: it used nothing (its rpm place too goes back)."""
        if self.open:
            self.open = False
            self.admission.held_bytes -= self.held
            self.tenant.refused()
            self.tenant.charge_tokens(-self.reserved)

    def settle(self, job: Job, outcome) -> None:
        """The job ended: the reserve settles to what it used."""
        if not self.open:
            return
        self.open = False
        self.admission.held_bytes -= self.held
        tenant = self.tenant
        tenant.release()
        usage = outcome.usage if isinstance(outcome, Done) else {}
        meter = job.meter
        used = (int(usage.get("input_tokens") or (meter.prompt if meter else self.estimate))
                + int(usage.get("output_tokens") or (meter.output if meter else 0)))
        tenant.charge_tokens(used - self.reserved)
