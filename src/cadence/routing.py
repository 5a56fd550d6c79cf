"""Which replica of a fleet serves a request: one pure routing function for `cadence sim` and the fleet.

A router sees each replica as a `ReplicaStats`: its running and waiting requests, its free KV
blocks, and a bounded digest of the prefix blocks it holds (fingerprints of the KV manager's own
block hashes). A request is seen as the fingerprints of its block-hash chain, computed with the KV
manager's hash function and the request's cache salt, so equal fingerprints mean equal whole
prefixes.

`prefix-affinity` scores each replica by the prefix blocks that would hit there (the longest
cached prefix of the request's chain, never its first block alone: one shared system prompt
would otherwise send everything to one replica) minus a load term, and falls back to the least
loaded when the fleet is unbalanced (an absolute and a relative threshold, as SGLang's router
and Ray's prefix-aware router do). `least-loaded` takes the fewest requests, `round-robin` the
next in turn; ties rotate so that an idle fleet still spreads its load.

Stats are snapshots a replica publishes now and then (`STATS_PERIOD_S`); `Router` remembers where
it sent recent chains so that a family's second request finds the first one's replica before the
next snapshot shows it. Imports only the standard library and the KV manager's hashing.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from cadence.kv.hashing import BlockHash

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")
DIGEST_LIMIT = 4096  # fingerprints a replica publishes at most (8 bytes each on the wire)
STATS_PERIOD_S = 1.0  # how often a replica publishes its stats
RECENT_CHAIN_BLOCKS = 512  # leading blocks of a chain the router remembers sending (more would cost, not help)
log = logging.getLogger("cadence.routing")


def fingerprint(block_hash: BlockHash) -> int:
    """A block hash as a 64-bit integer: the first 8 bytes of a SHA-256 digest; a builtin hash (a
    64-bit integer already) as is."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[:8], "little")
    return block_hash


def fingerprints(chain: Iterable[BlockHash]) -> tuple[int, ...]:
    hashes = tuple(chain)
    if hashes and not isinstance(hashes[0], bytes):  # builtin hashes: (the simulator's default) no work
        return cast("tuple[int, ...]", hashes)  # (a chain is all of one algorithm)
    return tuple(map(fingerprint, hashes))


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """What a router knows of one replica: requests it holds (running, waiting), free KV blocks,
    and fingerprints of (up to `DIGEST_LIMIT` of) the prefix blocks it has cached."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    digest: frozenset[int] = frozenset()

    @property
    def load(self) -> int:
        return self.running + self.waiting

    def to_dict(self) -> dict[str, object]:
        """As a replica publishes it (Ray Serve's routing stats are a plain dict)."""
        return {"running": self.running, "waiting": self.waiting, "free_blocks": self.free_blocks,
                "digest": list(self.digest)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReplicaStats:
        """The inverse of `to_dict` (of a dict as Ray hands it on, untyped); missing fields (a replica
        that has not published yet) are zero."""
        digest = d.get("digest") or ()
        return cls(int(d.get("running", 0)), int(d.get("waiting", 0)), int(d.get("free_blocks", 0)), frozenset(digest))


@dataclass(frozen=True)
class RoutingConfig:
    """`load_weight`: prefix blocks one more request in a replica's queue is worth (a hit of more
    blocks than that outweighs one request of extra load). The fleet is unbalanced, and
    prefix-affinity falls back to least-loaded, when the busiest replica holds more than
    `balance_abs` requests more than the idlest and more than `balance_rel` times as many."""

    load_weight: float = 8.0
    balance_abs: int = 64
    balance_rel: float = 1.5

    def validate(self) -> RoutingConfig:
        if not self.load_weight >= 0:
            raise ValueError("load_weight: must be >= 0")
        if self.balance_abs < 0:
            raise ValueError("balance_abs: must be >= 0")
        if not self.balance_rel >= 1:
            raise ValueError("balance_rel: must be >= 1")
        return self


def check_router(name: str) -> str:
    if name not in ROUTERS:
        raise ValueError(f"router: expected one of {ROUTERS}, got {name!r}")
    return name


# ------------------------------------------------------------------------------------ pure parts
def matched_blocks(chain: Sequence[int], digest: Collection[int], recent: Mapping[int, Hashable] | None = None,
                   replica: Hashable = -1) -> int:
    """Leading blocks of `chain` cached on a replica: in its `digest`, or sent to it lately
    (`recent[fp] == replica`). Stops at the first miss: a later block is worth nothing without
    the ones before it."""
    n = 0
    for fp in chain:
        if fp in digest or (recent is not None and recent.get(fp) == replica):
            n += 1
        else:
            break
    return n


def unbalanced(loads: Sequence[int], cfg: RoutingConfig) -> bool:
    lo, hi = min(loads), max(loads)
    return hi - lo > cfg.balance_abs and hi > cfg.balance_rel * lo


def least_loaded(loads: Sequence[int], start: int = 0) -> int:
    """The first replica with the fewest requests, looking from `start` on and wrapping around."""
    n = len(loads)
    least = min(loads)
    start %= n
    for k in range(n):
        i = (start + k) % n
        if loads[i] == least:
            return i
    raise AssertionError("unreachable")


# What decided a choice (`Decision.outcome`): prefix-affinity sent the request to a replica with
# the longest cached prefix ("prefix"), to another for its load ("diverted"), to the least loaded
# because the fleet was unbalanced ("unbalanced") or because no replica held any of its prefix
# ("no-prefix"); round-robin and least-loaded decide by turn or load alone ("load").
OUTCOMES = ("prefix", "diverted", "unbalanced", "no-prefix", "load")


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice: the index into `stats`, what decided it (of `OUTCOMES`), and for
    prefix-affinity the leading blocks of the chain each replica holds (empty when not looked at)."""

    replica: int
    outcome: str
    hits: tuple[int, ...] = ()


def affinity_decision(chain: Sequence[int], stats: Sequence[ReplicaStats], start: int = 0,
                      cfg: RoutingConfig = RoutingConfig(), recent: Mapping[int, Hashable] | None = None,
                      ids: Sequence[Hashable] | None = None) -> Decision:
    """The replica with the best prefix hit minus load (see the module's docstring), and why. `recent`
    maps a block's fingerprint to the replica (its entry in `ids`, default its index) it was sent to."""
    loads = [s.load for s in stats]
    if not chain:
        return Decision(least_loaded(loads, start), "no-prefix")
    if unbalanced(loads, cfg):
        return Decision(least_loaded(loads, start), "unbalanced")
    keys = ids if ids is not None else range(len(stats))
    hits = tuple(matched_blocks(chain, s.digest, recent, k) for s, k in zip(stats, keys, strict=True))
    if not any(hits):
        return Decision(least_loaded(loads, start), "no-prefix", hits)
    n = len(stats)
    best, best_key = -1, None
    for k in range(n):  # ties: the less loaded, then the first from `start`
        i = (start + k) % n
        key = (hits[i] - cfg.load_weight * loads[i], -loads[i])
        if best_key is None or key > best_key:
            best, best_key = i, key
    return Decision(best, "prefix" if hits[best] == max(hits) else "diverted", hits)


def prefix_affinity(chain: Sequence[int], stats: Sequence[ReplicaStats], start: int = 0,
                    cfg: RoutingConfig = RoutingConfig(), recent: Mapping[int, Hashable] | None = None,
                    ids: Sequence[Hashable] | None = None) -> int:
    """`affinity_decision`'s replica."""
    return affinity_decision(chain, stats, start, cfg, recent, ids).replica


def decide(policy: str, chain: Sequence[int], stats: Sequence[ReplicaStats], start: int = 0,
           cfg: RoutingConfig = RoutingConfig(), recent: Mapping[int, Hashable] | None = None,
           ids: Sequence[Hashable] | None = None) -> Decision:
    """The replica for a request whose block chain fingerprints are `chain`, and why; `start` is the
    rotation cursor ties are broken from."""
    if not stats:
        raise ValueError("stats: no replica to route to")
    if policy == "round-robin":
        return Decision(start % len(stats), "load")
    if policy == "least-loaded":
        return Decision(least_loaded([s.load for s in stats], start), "load")
    if policy == "prefix-affinity":
        return affinity_decision(chain, stats, start, cfg, recent, ids)
    raise ValueError(f"router: expected one of {ROUTERS}, got {policy!r}")


def choose(policy: str, chain: Sequence[int], stats: Sequence[ReplicaStats], start: int = 0,
           cfg: RoutingConfig = RoutingConfig(), recent: Mapping[int, Hashable] | None = None,
           ids: Sequence[Hashable] | None = None) -> int:
    """Index into `stats` of the replica for a request whose block chain fingerprints are `chain`
    (`decide`'s replica)."""
    return decide(policy, chain, stats, start, cfg, recent, ids).replica


# ------------------------------------------------------------------------------------ the router
@dataclass
class Router:
    """`choose` with its state: the rotation cursor and, for prefix-affinity, where recent chains
    went (bounded, least recently used forgotten first). Replicas are named by `ids` (stable
    across calls, as a fleet's replica ids are), by default their indices in `stats`."""

    policy: str
    cfg: RoutingConfig = field(default_factory=RoutingConfig)
    recent_limit: int = 1 << 16
    decisions: Counter[str] = field(default_factory=Counter)  # choices made, by `Decision.outcome`
    _next: int = 0
    _recent: OrderedDict[int, Hashable] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        check_router(self.policy)
        self.cfg.validate()

    @property
    def wants_prefixes(self) -> bool:
        """Whether requests' chains and replicas' digests matter (else they may be left empty)."""
        return self.policy == "prefix-affinity"

    def route(self, chain: Sequence[int], stats: Sequence[ReplicaStats], ids: Sequence[Hashable] | None = None) -> int:
        """Index into `stats` of the replica for a request with block chain `chain` (`decide`, whose
        outcome it counts and, at DEBUG, logs with each replica's load and cached blocks)."""
        return self.decide(chain, stats, ids).replica

    def decide(self, chain: Sequence[int], stats: Sequence[ReplicaStats],
               ids: Sequence[Hashable] | None = None) -> Decision:
        """`route`, with what decided it."""
        recent = self._recent if self.wants_prefixes else None
        d = decide(self.policy, chain, stats, self._next, self.cfg, recent, ids)
        i = d.replica
        self.decisions[d.outcome] += 1
        if log.isEnabledFor(logging.DEBUG):
            names = list(ids) if ids is not None else list(range(len(stats)))
            log.debug("route %d blocks -> %s (%s); loads %s, cached blocks %s", len(chain), names[i], d.outcome,
                      dict(zip(names, (s.load for s in stats), strict=True)),
                      dict(zip(names, d.hits, strict=True)) if d.hits else "-")
        self._next = i + 1
        if recent is not None:
            key = ids[i] if ids is not None else i
            for fp in chain[:RECENT_CHAIN_BLOCKS]:
                recent[fp] = key
                recent.move_to_end(fp)
            while len(recent) > self.recent_limit:
                recent.popitem(last=False)
        return d

    def decision_counts(self) -> dict[str, int]:
        """`decisions` with every outcome this router's policy can reach, 0 where none came."""
        reachable = tuple(o for o in OUTCOMES if o != "load") if self.wants_prefixes else ("load",)
        return {o: self.decisions[o] for o in reachable}

    def route_by_load(self, loads: Sequence[int]) -> int:
        """`route` for round-robin and least-loaded, which read nothing but each replica's load
        (running + waiting): the same choice without building the stats."""
        if self.wants_prefixes:
            raise ValueError("route_by_load: prefix-affinity needs the replicas' stats")
        i = self._next % len(loads) if self.policy == "round-robin" else least_loaded(loads, self._next)
        self._next = i + 1
        self.decisions["load"] += 1
        return i

    def forget_replica(self, key: Hashable) -> None:
        """A replica lost its cache (it restarted, or left): drop what was sent to it."""
        for fp in [fp for fp, r in self._recent.items() if r == key]:
            del self._recent[fp]
