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

    def add_running(self, req: Request, n: int, block_table: tuple[int, ...], batch: bool) -> None:
        """Plan `n` tokens for running request `req`: with `batch`, a plain decode's row is the
        request itself (a row of the step's `DecodeBatch`). The plain version of what
        `Scheduler._schedule_running` does inline, per decode per step (tests/unit/test_references.py
        compares the two)."""
        if batch and not is_prefill(req, n) and req.sampling_params.plain_decode:
            self.rows[req.request_id] = req
            self.budget -= n
        else:
            self.add(req, n, block_table)

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
    (a plain decode): this runs every step, and `type() is` is the cheapest test
    (`split_rows_reference` is the plain version, which tests compare)."""
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


def split_rows_reference(rows: dict[str, ScheduledRequest | Request], tables: Mapping[str, tuple[int, ...]],
                         ) -> tuple[tuple[ScheduledRequest, ...], DecodeBatch, tuple[int, ...]]:
    """`split_rows`, plainly: rows told apart by `isinstance`, the batch built row by row."""
    records: list[ScheduledRequest] = []
    before: list[int] = []
    decodes: list[Request] = []
    for row in rows.values():
        if isinstance(row, Request):
            decodes.append(row)
        else:
            records.append(row)
            before.append(len(decodes))
    if not decodes:
        return tuple(records), NO_DECODES, tuple(before)
    batch = DecodeBatch(
        request_ids=tuple(r.request_id for r in decodes),
        token_ids=tuple(r.output_token_ids[-1] for r in decodes),
        start_pos=tuple(r.num_computed_tokens for r in decodes),
        block_tables=tuple(tables[r.request_id] for r in decodes),
        sampling_params=tuple(r.sampling_params for r in decodes),
        num_output_tokens=tuple(r.num_output_tokens for r in decodes),
        eos_token_ids=tuple(r.eos_token_ids for r in decodes),
    )
    return tuple(records), batch, tuple(before)
