"""Disaggregated prefill and decode: the replica side.

A `PDReplica` is a fleet replica (one `AsyncEngine`) with the calls of both pools:

- prefill: `prefill` runs a request for its first token, then sends the prompt's KV blocks that
  the decode side asked for (a `KVExport`, the last item of the stream);
- decode: `reserve_kv` holds blocks for a prompt's full blocks (pinning those it has cached and
  allocating the rest) and answers which must come; `decode` writes the arrived blocks, publishes
  them as prefix-cache entries and admits the request (prompt and first token), which finds them
  as hits; `release_kv` drops a reservation nobody will use.

The ingress (`pd_client.PDFleetClient`) drives the hand-off. A reservation not bound to a request
within its time to live is dropped by the engine itself, so an ingress that goes away leaks nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from cadence.engine.kv_transfer import KVExport
from cadence.engine.output_processor import StreamDelta, shown_text
from cadence.errors import AdmissionError, CadenceError
from cadence.fleet.protocol import Failed, GenerateCall, Refused, Target, deltas_of
from cadence.fleet.replica import CadenceReplica

REIMPORT_TTL_S = 10.0  # a reservation made again at import: its request is bound at once, or it is released


@dataclass(frozen=True)
class Reserved:
    """A decode replica's answer to `reserve_kv`: `missing` the chain positions whose KV must come
    (None: too few free blocks now)."""

    replica: str
    missing: tuple[int, ...] | None
    free_blocks: int


class PDReplica(CadenceReplica):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from cadence.metrics.prometheus import KVTransferMetrics

        self.transfer_metrics = KVTransferMetrics(self.exporter.registry)

    # -- the prefill pool ----------------------------------------------------------------------------

    async def prefill(self, call: GenerateCall, positions: tuple[int, ...] | None) -> AsyncIterator[Any]:
        """`generate` (the call's max_tokens is 1), then the prompt's blocks at `positions` as a
        `KVExport` unless the request failed.

        A request that ends at its token limit goes on on a decode replica: its text is what a stream
        shows before its end (`shown_text`), not the flushed end of one, so what may still become a
        character or a stop string with the next tokens is left for the decode replica to show."""
        failed = False
        ids: list[int] = []
        shown = 0
        async for batch in self.generate(call):
            for item in deltas_of(batch):  # (one by one: the ingress reads a prefill stream item by item)
                failed = failed or isinstance(item, (Refused, Failed)) or getattr(item, "error", None) is not None
                if isinstance(item, StreamDelta):
                    ids += item.token_ids
                    if item.finish_reason == "length" and item.error is None:
                        text = shown_text(self.engine.tokenizer, call.params, ids)
                        item = replace(item, text=text[shown:])
                    shown += len(item.text)
                yield item
        if failed:
            return
        prompt, salt = call.prompts[0], call.policy.cache_salt
        transfer = self.engine.kv_transfer
        yield await self.engine.run_in_engine(lambda: transfer.export(prompt, salt, positions))

    # -- the decode pool -----------------------------------------------------------------------------

    async def reserve_kv(self, key: str, prompt: list[int], salt: str | None, ttl: float) -> Reserved:
        transfer = self.engine.kv_transfer
        missing = await self.engine.run_in_engine(lambda: transfer.reserve(key, prompt, salt, ttl))
        if missing is None:
            self.transfer_metrics.refused.inc()
        return Reserved(self.name, None if missing is None else tuple(missing),
                        self.engine.core.scheduler_stats.num_free_blocks)

    async def release_kv(self, key: str, target: Target | None = None) -> bool:
        transfer = self.engine.kv_transfer
        return bool(await self.engine.run_in_engine(lambda: transfer.release(key)))

    async def decode(self, call: GenerateCall, key: str, export: KVExport, target: Target | None = None
                     ) -> AsyncIterator[Any]:
        """Import the blocks reserved under `key`, then `generate` the call there."""
        start_ns, started = time.time_ns(), time.monotonic()
        transfer = self.engine.kv_transfer
        try:
            published = await self.engine.run_in_engine(lambda: self._import(key, call, export))
        except (KeyError, ValueError, CadenceError) as e:
            await self._release(key)
            yield Refused("unavailable", f"importing the KV blocks failed: {e}", None, None, False, self.name)
            return
        if published is not None:
            self.transfer_metrics.record_import(export.nbytes, len(export.positions),
                                                max(0, published - len(export.positions)),
                                                max(0.0, time.time() - export.sent_at))
        policy = call.policy
        if policy.handoff is not None:  # (its times were taken by the ingress before the import)
            policy = replace(policy, handoff=policy.handoff.later(time.monotonic() - started))
        try:
            stream = await self.engine.submit(call.prompts, call.params, request_id=call.request_id,
                                              policy=policy, emitted=call.num_emitted)
        except CadenceError as e:
            await self._release(key)
            yield Refused(e.kind.value, str(e), e.param, e.retry_after, isinstance(e, AdmissionError), self.name)
            return
        await self.engine.run_in_engine(lambda: transfer.bind(key, call.request_id))
        async for item in self._serve(call, stream, start_ns):
            yield item

    def _import(self, key: str, call: GenerateCall, export: KVExport) -> int | None:
        """(On the engine thread.) Write the arrived blocks into the reservation and publish them;
        the blocks published, or None when none could be taken. A reservation that expired (its
        prefill waited longer than its time to live: a queue of long prompts, a replica starting)
        is made again; without room for it now, the request recomputes its prompt, held to the KV
        cache by the engine's own admission like any other."""
        transfer = self.engine.kv_transfer
        if not transfer.holds(key):
            prompt = call.prompts[0][: len(call.prompts[0]) - call.num_emitted]
            if transfer.reserve(key, prompt, call.policy.cache_salt, REIMPORT_TTL_S) is None:
                return None
        return transfer.write(key, export)

    async def _release(self, key: str) -> None:
        transfer = self.engine.kv_transfer
        with contextlib.suppress(CadenceError):  # the engine is down: its blocks went with it
            await self.engine.run_in_engine(lambda: transfer.release(key))

    def kv_state(self, target: Target | None = None) -> tuple[str, int, int, int]:
        """(name, free blocks, blocks held for arriving KV, reservations): for tests and operators."""
        core = self.engine.core
        transfer = self.engine.kv_transfer
        return self.name, core.kv.num_free_blocks, core.kv.num_import_blocks, transfer.num_reservations
