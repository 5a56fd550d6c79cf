"""One step being planned (`StepPlan`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cadence.boundary import ScheduledRequest
from cadence.request import Request
from cadence.sched.records import scheduled_request


@dataclass
class StepPlan:
    """One step being planned: each scheduled request's record (in scheduling order) and what is
    left. A request preempted later in the plan has its record dropped.
    """

    budget: int
    rows: dict[str, ScheduledRequest] = field(default_factory=dict)
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
        return 0 if row is None else len(row.token_ids)

    def undo(self, req: Request) -> None:
        """Forget `req`'s share of the plan (it was just preempted), if it had one."""
        row = self.rows.pop(req.request_id, None)
        if row is not None:
            n = len(row.token_ids)
            if not row.num_draft_tokens and is_prefill(req, n):  # (a verification row is decode)
                self.num_prefill -= n
            self.budget += n


def is_prefill(req: Request, n: int) -> bool:
    """A decode is one token at an output position; prompt chunks and recompute are prefill.
    `req.num_computed_tokens` must still be where the chunk starts (it advances in `update`)."""
    return n != 1 or req.num_computed_tokens < len(req.prompt_token_ids)
