"""One step being planned (`StepPlan`), and its rows split into the step's records and its batch
of plain decodes (`split_rows`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cadence.boundary import NO_DECODES, DecodeBatch, ScheduledRequest
from cadence.request import Request
from cadence.sched.records import decode_batch, scheduled_request


@dataclass
class StepPlan:
    """One step being planned: each scheduled request's row (in scheduling order) and what is left.

    A row is the request's record, or (batch mode) the `Request` itself for a plain decode, whose
    columns are read when the step's `DecodeBatch` is built. Either way nothing read (progress,
    outputs, the request's own block table) changes later in the same `schedule`, and a request
    preempted later in the plan has its row dropped.
    """

    budget: int
    rows: dict[str, ScheduledRequest | Request] = field(default_factory=dict)
    num_prefill: int = 0  # tokens of the records that are prefill (prompt chunks and recompute)
    preempted: list[str] = field(default_factory=list)

    def add(self, req: Request, n: int, block_table: tuple[int, ...]) -> None:
        self.rows[req.request_id] = scheduled_request(req, n, block_table)
        if is_prefill(req, n):
            self.num_prefill += n
        self.budget -= n

    def num_tokens(self, rid: str) -> int:
        """Tokens planned for request `rid` (0 if none)."""
        row = self.rows.get(rid)
        if row is None:
            return 0
        return len(row.token_ids) if type(row) is ScheduledRequest else 1

    def undo(self, req: Request) -> None:
        """Forget `req`'s share of the plan (it was just preempted), if it had one."""
        n = self.num_tokens(req.request_id)
        if n:
            del self.rows[req.request_id]
            if is_prefill(req, n):
                self.num_prefill -= n
            self.budget += n


def is_prefill(req: Request, n: int) -> bool:
    """A decode is one token at an output position; prompt chunks and recompute are prefill.
    `req.num_computed_tokens` must still be where the chunk starts (it advances in `update`)."""
    return n != 1 or req.num_computed_tokens < len(req.prompt_token_ids)


def split_rows(rows: dict[str, ScheduledRequest | Request], tables: Mapping[str, tuple[int, ...]],
               ) -> tuple[tuple[ScheduledRequest, ...], DecodeBatch, tuple[int, ...]]:
    """Batch mode: the records, the plain decodes as one batch, and how many decodes precede each
    record. A row is told apart by its exact type, a `ScheduledRequest` record or a `Request`
    (a plain decode): this runs every step, and `type() is` is the cheapest test."""
    records: list[ScheduledRequest] = []
    before: list[int] = []
    decodes: list[Request] = []
    for row in rows.values():
        if type(row) is ScheduledRequest:
            records.append(row)
            before.append(len(decodes))
        else:
            decodes.append(row)  # type: ignore[arg-type]
    batch = decode_batch(decodes, tables) if decodes else NO_DECODES
    return tuple(records), batch, tuple(before)
