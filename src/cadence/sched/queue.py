"""Waiting-queue policies behind one interface; `make_queue(config)` picks one by name.

The scheduler only asks a queue for the next request it may admit (`peek(eligible)`), takes it
out (`remove`), returns preempted requests to it (`push_front`) and reports service
(`account`). It never asks which policy it holds. Admission control asks it one more thing: what
to do with arrivals that would overflow a bounded queue (`overflow`). Every policy but fair share
answers "refuse them"; fair share refuses them only when their tenant is the one over its share of
the queue, and otherwise names the queued requests to drop to make room.

`push_front` puts a preempted request ahead of everything it ties with: the absolute head for
FCFS, the head of its priority class, the head of its tenant's line, the head of its deadline.
Preempted requests keep their original ordering key, so a victim never jumps a request the
policy ranks above it (which would only get it preempted again).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cadence.config import SchedulerConfig
from cadence.request import Request

Eligible = Callable[[Request], bool]

# VTC charges an output token more than an input token (decode is the costlier work per token);
# the paper's default weights are 1 and 2.
OUTPUT_TOKEN_WEIGHT = 2.0
# A request without a deadline is ranked as if it had this much slack, so aging can reach it.
NO_DEADLINE_SLACK = 60.0


@dataclass(frozen=True)
class QueueBound:
    """One limit on the waiting queue: at most `limit` of what `size` counts per request."""

    limit: int
    unit: str  # what is counted, for messages: "requests", "prompt tokens"
    size: Callable[[Request], int]

    def total(self, requests: Iterable[Request]) -> int:
        return sum(self.size(r) for r in requests)


@dataclass(frozen=True)
class ShareUse:
    """What a tenant holds of a bounded queue, against its fair share of it."""

    tenant: str
    held: float
    share: float
    bound: QueueBound

    def describe(self) -> str:
        b = self.bound
        return f"{self.held:g} of the {b.limit} queued {b.unit}, over its share of {self.share:.3g}"


@dataclass(frozen=True)
class Overflow:
    """A policy's answer to arrivals that would overflow the queue.

    `over_share`: refuse them, their tenant would hold more than its share. `evict`: make room by
    ending these queued requests (each with what its tenant held). Neither: refuse them, naming
    the queue only (every policy but fair share, or no tenant to take the room from)."""

    over_share: ShareUse | None = None
    evict: tuple[tuple[Request, ShareUse], ...] = ()


class RequestQueue(ABC):
    """Waiting requests in a policy's order. Also tracks their prompt tokens for admission bounds."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._num_tokens = 0

    # --- the interface the scheduler uses
    def add(self, request: Request) -> None:
        """A new arrival."""
        self._track(request)
        self._insert(request, front=False)

    def push_front(self, request: Request) -> None:
        """A preempted request: ahead of everything it ties with (see module doc)."""
        self._track(request)
        self._insert(request, front=True)

    def peek(self, eligible: Eligible | None = None) -> Request | None:
        """The next request in policy order for which `eligible` holds (all, if None).

        `eligible` must judge a request by its tenant alone (the scheduler uses it for per-tenant
        caps): fair share skips a whole tenant whose head request is not eligible.
        """
        return self._peek(eligible) if self._requests else None

    def pop(self, eligible: Eligible | None = None) -> Request | None:
        request = self.peek(eligible)
        if request is not None:
            self.remove(request)
        return request

    def remove(self, request: Request) -> bool:
        """Take a request out (admitted or aborted). False if it was not waiting."""
        if self._requests.pop(request.request_id, None) is None:
            return False
        self._num_tokens -= request.num_prompt_tokens
        self._discard(request)
        return True

    # Whether `account` does anything: the scheduler skips the call, once per request per step, if not.
    tracks_service = False

    def account(self, request: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:  # noqa: B027
        """Service a request received in one step. A no-op hook: only fair share uses it."""

    def overflow(self, arrivals: Sequence[Request], bounds: Sequence[QueueBound]) -> Overflow:
        """`arrivals` (one client request: the same tenant) would take the queue over each of
        `bounds`. Changes nothing; see `Overflow`. By default: refuse them, whoever sent them."""
        return Overflow()

    def position(self, request: Request) -> int | None:
        """How many waiting requests the policy ranks ahead of `request` (None if it is not
        waiting). Walks the queue: for a client's occasional question, never per step."""
        if request.request_id not in self._requests:
            return None
        return next(i for i, r in enumerate(self) if r is request)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._requests

    @property
    def num_tokens(self) -> int:
        """Prompt tokens of all waiting requests."""
        return self._num_tokens

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (policy order, except fair share: tenant by tenant)."""

    # --- what a policy implements
    @abstractmethod
    def _insert(self, request: Request, front: bool) -> None: ...

    @abstractmethod
    def _peek(self, eligible: Eligible | None) -> Request | None: ...

    @abstractmethod
    def _discard(self, request: Request) -> None: ...

    def _track(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        self._requests[request.request_id] = request
        self._num_tokens += request.num_prompt_tokens


def _first_eligible(requests: Iterator[Request], eligible: Eligible | None) -> Request | None:
    for req in requests:
        if eligible is None or eligible(req):
            return req
    return None


class FCFSQueue(RequestQueue):
    """First come, first served."""

    def __init__(self) -> None:
        super().__init__()
        self._line: OrderedDict[str, Request] = OrderedDict()

    def _insert(self, request: Request, front: bool) -> None:
        self._line[request.request_id] = request
        if front:
            self._line.move_to_end(request.request_id, last=False)

    def _peek(self, eligible: Eligible | None) -> Request | None:
        return _first_eligible(iter(self._line.values()), eligible)

    def _discard(self, request: Request) -> None:
        del self._line[request.request_id]

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._line.values()))


class _HeapQueue(RequestQueue):
    """Ordered by a key fixed at insertion; ties go to the earliest inserted, push_front first.

    Removal is lazy (the entry is marked dead), so remove is O(1) and peek amortised O(log n).
    """

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[list[Any]] = []  # [key, seq, request | None]
        self._entries: dict[str, list[Any]] = {}
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)  # push_front wins every tie with a later add

    @abstractmethod
    def _key(self, request: Request) -> float | tuple[float, ...]: ...

    def _insert(self, request: Request, front: bool) -> None:
        seq = next(self._front) if front else next(self._back)
        entry = [self._key(request), seq, request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _discard(self, request: Request) -> None:
        self._entries.pop(request.request_id)[2] = None

    def _peek(self, eligible: Eligible | None) -> Request | None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if not heap or eligible is None or eligible(heap[0][2]):
            return heap[0][2] if heap else None
        # Pop in order until an eligible one shows, then put the skipped ones back.
        skipped: list[list[Any]] = []
        found: Request | None = None
        while heap:
            entry = heapq.heappop(heap)
            if entry[2] is None:
                continue
            skipped.append(entry)
            if eligible(entry[2]):
                found = entry[2]
                break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def __iter__(self) -> Iterator[Request]:
        live = sorted((e for e in self._entries.values()), key=lambda e: (e[0], e[1]))
        return iter([e[2] for e in live])


class PriorityQueue(_HeapQueue):
    """Lower `priority` value first; first come, first served within a class."""

    def _key(self, request: Request) -> float:
        return request.priority


class DeadlineQueue(_HeapQueue):
    """Earliest effective deadline first, with aging.

    Waiting `aging` seconds counts as one second nearer the deadline, so the effective deadline
    at time t is `deadline - (t - arrival) / aging`. Every waiting request ages at the same rate,
    so the order is that of the fixed key `deadline + arrival / aging`: a request with a far (or
    no) deadline is overtaken only by requests that arrived not much later than it, and so is
    served after a bounded wait instead of starving.
    """

    def __init__(self, aging: float) -> None:
        if aging <= 0:
            raise ValueError("deadline_aging: must be > 0")
        super().__init__()
        self._aging = aging

    def _key(self, request: Request) -> float:
        deadline = request.deadline
        if deadline is None:
            deadline = request.arrival_time + NO_DEADLINE_SLACK
        return deadline + request.arrival_time / self._aging


class FairQueue(RequestQueue):
    """Per-tenant fair share by virtual token counters (VTC, Sheng et al., OSDI 2024).

    Each tenant has a counter advanced by the service its requests receive (prompt tokens
    computed + OUTPUT_TOKEN_WEIGHT * output tokens), divided by its weight. The next request
    comes from the backlogged tenant with the lowest counter, FCFS within the tenant. A tenant
    that becomes backlogged after idling has its counter lifted to the lowest counter among
    backlogged tenants (or, if none, to that of the tenant that last left the queue), so idle
    time cannot be banked as credit.
    """

    tracks_service = True

    def __init__(self, weights: dict[str, float] | None = None, output_weight: float = OUTPUT_TOKEN_WEIGHT) -> None:
        super().__init__()
        self._weights = dict(weights or {})
        if any(w <= 0 for w in self._weights.values()):
            raise ValueError("tenant_weights: weights must be > 0")
        self.output_weight = output_weight  # an output token's cost, in prompt tokens
        self._lines: dict[str, OrderedDict[str, Request]] = {}  # backlogged tenants only
        self.counters: dict[str, float] = {}
        self._last_left = 0.0

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def account(self, request: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        cost = num_prompt_tokens + self.output_weight * num_output_tokens
        if cost:
            tenant = request.tenant
            self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)

    @property
    def tenants(self) -> tuple[str, ...]:
        """The backlogged tenants (those with a request waiting), in the order they became so."""
        return tuple(self._lines)

    def _insert(self, request: Request, front: bool) -> None:
        tenant = request.tenant
        line = self._lines.get(tenant)
        if line is None:
            if not front:  # a returning preempted request was active, not idle: no lift
                self._lift(tenant)
            line = self._lines[tenant] = OrderedDict()
        line[request.request_id] = request
        if front:
            line.move_to_end(request.request_id, last=False)

    def _lift(self, tenant: str) -> None:
        floor = min(self.counters.get(t, 0.0) for t in self._lines) if self._lines else self._last_left
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _discard(self, request: Request) -> None:
        tenant = request.tenant
        line = self._lines[tenant]
        del line[request.request_id]
        if not line:
            del self._lines[tenant]
            self._last_left = self.counters.get(tenant, 0.0)

    def _peek(self, eligible: Eligible | None) -> Request | None:
        best: Request | None = None
        best_key: tuple[float, float] | None = None
        for tenant, line in self._lines.items():
            head = next(iter(line.values()))
            if eligible is not None and not eligible(head):
                continue  # eligibility is per tenant (caps), so the whole line waits
            key = (self.counters.get(tenant, 0.0), head.arrival_time)
            if best_key is None or key < best_key:
                best, best_key = head, key
        return best

    def __iter__(self) -> Iterator[Request]:
        return iter([r for line in self._lines.values() for r in line.values()])

    def position(self, request: Request) -> int | None:
        """Within its tenant's line: the order between tenants follows their service, step by step."""
        line = self._lines.get(request.tenant)
        if line is None or request.request_id not in line:
            return None
        return next(i for i, rid in enumerate(line) if rid == request.request_id)

    def overflow(self, arrivals: Sequence[Request], bounds: Sequence[QueueBound]) -> Overflow:
        """Fair share of the queue itself: each backlogged tenant (and the arrivals') is entitled
        to `limit * weight / total weight` of each bound. While a bound is exceeded, the tenant
        holding the most per unit of weight gives up its newest request that has not started
        (a preempted one keeps its place), provided it holds more per weight than the arrivals'
        tenant would with them; otherwise the arrivals are refused: over their tenant's share
        when it would hold more than that share, else for the queue alone (the room is held by
        requests that cannot be dropped)."""
        tenant = arrivals[0].tenant
        held = {b: self._held(b) for b in bounds}
        totals = {b: sum(held[b].values()) + b.total(arrivals) for b in bounds}
        for b in bounds:
            held[b][tenant] = held[b].get(tenant, 0) + b.total(arrivals)
        count = {t: len(line) for t, line in self._lines.items()}
        count[tenant] = count.get(tenant, 0) + len(arrivals)
        # Evictable requests, newest first: not yet started, so nothing was streamed to their clients.
        spare = {t: [r for r in reversed(line.values()) if r.first_scheduled_time is None]
                 for t, line in self._lines.items() if t != tenant}
        evict: list[tuple[Request, ShareUse]] = []
        while (bound := next((x for x in bounds if totals[x] > x.limit), None)) is not None:
            weights = {t: self.weight(t) for t in count}
            per_weight = {t: held[bound].get(t, 0) / w for t, w in weights.items()}
            donor = max((t for t in spare if spare[t]), key=lambda t: per_weight[t], default=None)
            if donor is None or per_weight[donor] <= per_weight[tenant]:
                share = bound.limit * weights[tenant] / sum(weights.values())
                if held[bound][tenant] > share:
                    return Overflow(over_share=ShareUse(tenant, held[bound][tenant], share, bound))
                return Overflow()
            victim = spare[donor].pop(0)
            share = bound.limit * weights[donor] / sum(weights.values())
            evict.append((victim, ShareUse(donor, held[bound][donor], share, bound)))
            for bb in bounds:
                size = bb.size(victim)
                held[bb][donor] -= size
                totals[bb] -= size
            count[donor] -= 1
            if not count[donor]:  # its line is empty: the shares divide among the others
                del count[donor]
        return Overflow(evict=tuple(evict))

    def _held(self, bound: QueueBound) -> dict[str, int]:
        return {t: bound.total(line.values()) for t, line in self._lines.items()}


_FACTORIES: dict[str, Callable[[SchedulerConfig], RequestQueue]] = {
    "fcfs": lambda cfg: FCFSQueue(),
    "priority": lambda cfg: PriorityQueue(),
    "fair": lambda cfg: FairQueue(dict(cfg.tenant_weights)),
    "deadline": lambda cfg: DeadlineQueue(cfg.deadline_aging),
}


def make_queue(config: SchedulerConfig) -> RequestQueue:
    factory = _FACTORIES.get(config.policy)
    if factory is None:
        raise ValueError(f"policy: must be one of {tuple(_FACTORIES)}")
    return factory(config)
