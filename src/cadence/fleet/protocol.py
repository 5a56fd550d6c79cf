"""What travels between the ingress and a replica (pickled by Ray)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cadence.request import DEFAULT_POLICY, RequestPolicy, SamplingParams


@dataclass(frozen=True)
class GenerateCall:
    """One client request, validated and tokenized at the ingress. `chain`: the fingerprints of
    its first prompt's block-hash chain (the KV manager's function and the request's cache salt),
    which the fleet's router scores replicas by. `trace_context`: traceparent (and tracestate) of the
    ingress's span, which the replica's own span continues."""

    prompts: tuple[list[int], ...]
    params: SamplingParams
    request_id: str
    policy: RequestPolicy = DEFAULT_POLICY
    chain: tuple[int, ...] = ()
    trace_context: dict[str, str] | None = None  # the ingress span's W3C context, when traced
    queue_status: bool = False  # Admitted carries the request's snapshots as admitted
    # The prompt's last tokens that are output another replica streamed already (a disaggregated
    # request's first token): the decode replica's text and stop strings continue from them.
    num_emitted: int = 0
    # Replicas that refused the request for a full queue: the router places it elsewhere.
    avoid: tuple[str, ...] = ()
    # The ingress subscription (`CadenceReplica.subscribe`) the request's deltas travel on; None:
    # on the call's own stream, after its admission.
    subscriber: str | None = None
    # time.time() when the ingress first sent it: a request held there for a replica with room
    # has waited that long of its deadline (`policy_at_replica`). None: no time taken off.
    sent_at: float | None = None


def policy_at_replica(call: GenerateCall, now: float) -> RequestPolicy:
    """The call's policy as its replica's engine takes it: the seconds since the ingress first sent
    it (`now`: time.time() on the replica) taken off its deadline, which counts from the request's
    arrival; a deadline that passed while the request was held is refused by the engine."""
    policy = call.policy
    if policy.deadline is None or call.sent_at is None:
        return policy
    return replace(policy, deadline=policy.deadline - max(0.0, now - call.sent_at))




@dataclass(frozen=True)
class Admitted:
    """The replica's engine took the request; deltas follow."""

    replica: str
    status: tuple[Any, ...] | None = None  # RequestSnapshots at admission, when the call asked


@dataclass(frozen=True)
class Refused:
    """The replica's engine refused the request (nothing follows)."""

    kind: str  # an ErrorKind value
    message: str
    param: str | None
    retry_after: float | None
    admission: bool  # an AdmissionError (a refusal before any work) rather than another error
    replica: str


@dataclass(frozen=True)
class Failed:
    """The request failed after it was admitted (nothing follows)."""

    kind: str
    message: str
    retry_after: float | None = None  # a refusal's Retry-After (a queued request dropped for fair share)


@dataclass(frozen=True)
class Deltas:
    """Several `StreamDelta`s of one request that were ready at once (several choices, a verified
    draft's tokens, deltas that piled up while the reader was slow), sent as one stream item:
    one Ray message instead of one each."""

    items: tuple[Any, ...]


def deltas_of(item: Any) -> tuple[Any, ...]:
    """The items a stream item stands for: a `Deltas`' deltas, else the item itself."""
    return item.items if isinstance(item, Deltas) else (item,)


@dataclass(frozen=True)
class Target:
    """Passed to a replica method, it makes the fleet's router send the call to that replica
    (by its Serve replica id): for reading each replica's metrics or state."""

    replica_id: str
