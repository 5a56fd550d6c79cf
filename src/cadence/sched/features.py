"""A step's shape (`StepFeatures`): what the step-cost model is linear in.

Pure Python (no numpy): the scheduler prices the steps it plans with it (speculative decoding's
adaptive k), the simulator and calibration measure and fit it (cost_model.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cadence.boundary import ScheduledRequest, SchedulerOutput

# Base quantities every feature set is linear in; the fitted model folds into one weight per base.
BASES = ("const", "prefill_tokens", "prefill_seqs", "decode_seqs", "sampled", "decode_context",
         "decode_padded", "decode_over_16k", "decode_over_32k", "decode_over_64k", "prefill_attention",
         "prefill_step", "decode_seqs_beside_prefill", "decode_context_shared", "prefill_context")
# The two paths of a CPU step (model/llama.py): an all-decode step runs every layer in one kernel
# call; a step with a prompt chunk runs them one by one from Python, at a fixed cost more
# ("prefill_step": 1 for such a step), and its decode rows go through the same matmuls as the
# chunk's tokens, so they cost what a prompt token does, not what a row of the one-call path does
# ("decode_seqs_beside_prefill": the decode rows of such a step).
# Decode rows whose tables share blocks (a common prompt prefix from the prefix cache) read those
# blocks again while they are still in the CPU's caches: each re-read key costs about a third less
# than a key read once ("decode_context_shared": see `shared_decode_keys`).
# A prompt chunk's attention reads its whole context (the cached keys before it and its own) once
# per chunk for each layer and head, whatever the chunk's length, beside the work per (query, key)
# pair: "prefill_context" is the chunks' context lengths summed (start + tokens of each), what
# keeps a short chunk over a long cached context dearer than its pairs alone say. It is derived
# from the step's totals (`prefill_context`), so step logs and profiles need no new field.
# Where the gathered decode context outgrows the CPU's caches, each key costs more: hinges at a few
# candidate knees (keys read by the decode batch) let the fit find the bend on this machine.
KNEES = {"decode_over_16k": 16384, "decode_over_32k": 32768, "decode_over_64k": 65536}
KNEE_1, KNEE_2, KNEE_3 = KNEES.values()  # in BASES order, for the places that evaluate the hinges


def prefill_context(tokens: int, seqs: int, attention: int) -> float:
    """The chunks' context lengths summed (each its start position plus its tokens), from the step's
    prefill tokens, chunk rows and (query, key) pairs: exact for one chunk (a chunk of n tokens
    from position s has n * s + n * (n + 1) / 2 pairs, so s + n = pairs / n + (n - 1) / 2) and for
    chunks of one length, near it otherwise."""
    return seqs * attention / tokens + (tokens - seqs) / 2 if tokens else 0.0


def scan_rows(rows: Sequence[ScheduledRequest], token: int) -> tuple[int, int, int, int, int, int, int, dict[str, int]]:
    """One pass over a step's rows: its prefill tokens, prefill rows, decode rows, decode keys, longest
    decode context, prefill (query, key) pairs, positions whose logits are computed (a verification
    row of speculative drafts computes 1 + k) (see `StepFeatures`), and each row that samples,
    mapped to `token`. Shared by `StepFeatures.from_output` and `SimExecutor.execute`, which needs
    both in one pass (it runs once per simulated step).

    A verification row of n = 1 + k tokens from position p is n decode rows of contexts p + 1 ..
    p + n in a step without a prompt chunk (the runner lays it out so, and the step takes the
    one-call decode path), and a chunk of n tokens in a step with one (`is_verification`)."""
    pt = ps = ds = dc = dmax = pa = sm = 0
    vn = vs = vkeys = vmax = 0  # verification rows: their tokens, rows, keys (= chunk pairs), longest context
    sampled: dict[str, int] = {}
    for r in rows:
        n = len(r.token_ids)
        if n == 1:
            ds += 1
            ctx = r.start_pos + 1
            dc += ctx
            if ctx > dmax:
                dmax = ctx
        elif r.num_draft_tokens == n - 1:
            vn += n
            vs += 1
            vkeys += n * r.start_pos + n * (n + 1) // 2
            vmax = max(vmax, r.start_pos + n)
        else:
            pt += n
            ps += 1
            pa += n * r.start_pos + n * (n + 1) // 2
        if r.sample:
            sampled[r.request_id] = token
            sm += 1 + r.num_draft_tokens
    if vs and pt:
        pt, ps, pa = pt + vn, ps + vs, pa + vkeys
    elif vs:
        ds, dc, dmax = ds + vn, dc + vkeys, max(dmax, vmax)
    return pt, ps, ds, dc, dmax, pa, sm, sampled


def is_verification(r: ScheduledRequest) -> bool:
    """A verification row: the last sampled token and its drafts."""
    return r.num_draft_tokens > 0 and len(r.token_ids) == 1 + r.num_draft_tokens


def verifications_run_as_decodes(rows: Sequence[ScheduledRequest]) -> bool:
    """Every row a single-token decode or a verification row: a step whose verification rows the
    runner lays out as decode rows (where the model has the one-call decode kernel), and the cost
    model prices so (`scan_rows`)."""
    return all(len(r.token_ids) == 1 or is_verification(r) for r in rows)


def decode_contexts(rows: Sequence[ScheduledRequest]) -> list[tuple[int, Sequence[int]]]:
    """(context length, block table) of each decode row the step computes, in step order: the
    single-token rows, and, in a step without a prompt chunk, each position of a verification row
    (`scan_rows`)."""
    expand = verifications_run_as_decodes(rows)
    out: list[tuple[int, Sequence[int]]] = []
    for r in rows:
        n = len(r.token_ids)
        if n == 1 or (expand and is_verification(r)):
            out.extend((r.start_pos + 1 + i, r.block_table) for i in range(n))
    return out


def verification_shared_keys(start: int, k: int, block_size: int) -> int:
    """Keys the k draft positions of a verification row at `start`, laid out as decode rows after its
    first, read from blocks the rows before them in the row read (the request's own context)."""
    if k <= 0 or block_size <= 0:
        return 0
    table = range(-(-(start + 1 + k) // block_size))
    return sum(shared_keys_by_row(((start + 1 + i, table) for i in range(k + 1)), block_size))


def shared_decode_keys(rows: Sequence[ScheduledRequest], block_size: int) -> int:
    """Keys the step's decode rows read from blocks that an earlier decode row of the step already
    read: for each decode row, its context tokens lying in blocks of the earlier rows' contexts."""
    return shared_keys(decode_contexts(rows), block_size)


def shared_keys(contexts: Iterable[tuple[int, Sequence[int]]], block_size: int) -> int:
    """`shared_decode_keys` of decode rows given as (context length, block table), in step order."""
    return sum(shared_keys_by_row(contexts, block_size))


def shared_keys_by_row(contexts: Iterable[tuple[int, Sequence[int]]], block_size: int) -> list[int]:
    """Each row's part of `shared_keys`: its keys in blocks an earlier row's context covers. One
    pass with a set of the block ids seen, over only the blocks covering each row's context; a row
    sharing nothing costs a set test (`isdisjoint`)."""
    seen: set[int] = set()
    out = []
    for ctx, table in contexts:
        full, part = divmod(ctx, block_size)  # whole blocks, then the tokens of a partial last one
        table = table[: full + (part > 0)]
        shared = 0
        if seen and not seen.isdisjoint(table):
            # (Counted by C-level calls: the simulator runs this once a step for such a profile.)
            shared = block_size * sum(map(seen.__contains__, table[:full]))
            if part and len(table) > full and table[full] in seen:
                shared += part
        seen.update(table)
        out.append(shared)
    return out


@dataclass(frozen=True, slots=True)
class StepFeatures:
    """The shape of one step. A scheduled request with one token is a decode row (the runner lays
    it out with the decodes, whatever its phase); more tokens make a prefill chunk, except a
    verification row in a step without a chunk, which is 1 + k decode rows (`scan_rows`)."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    decode_seqs: int = 0
    sampled: int = 0  # positions whose logits go through the LM head and the sampler
    decode_context: int = 0  # keys attended by decode rows: sum of their context lengths
    decode_padded: int = 0  # decode rows x the longest decode context: keys a padded batch reads
    prefill_attention: int = 0  # (query, key) pairs of the chunks: n * start + n * (n + 1) / 2 each
    # Of `decode_context`, the keys in blocks an earlier decode row of the step read (shared_decode_keys)
    decode_context_shared: int = 0

    @classmethod
    def from_output(cls, out: SchedulerOutput, block_size: int = 0) -> StepFeatures:
        """The step's shape; its shared decode keys only with `block_size` (the tables' blocks' size),
        else 0."""
        pt, ps, ds, dc, dmax, pa, sm, _ = scan_rows(out.scheduled, 0)
        shared = shared_decode_keys(out.scheduled, block_size) if block_size else 0
        return cls(pt, ps, ds, sm, dc, ds * dmax, pa, shared)

    @property
    def num_tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    def bases(self) -> tuple[float, ...]:
        pad = self.decode_padded
        return (1.0, self.prefill_tokens, self.prefill_seqs, self.decode_seqs, self.sampled, self.decode_context,
                pad, max(0, pad - KNEE_1), max(0, pad - KNEE_2), max(0, pad - KNEE_3), self.prefill_attention,
                float(self.prefill_tokens > 0), self.decode_seqs if self.prefill_tokens else 0,
                self.decode_context_shared, prefill_context(self.prefill_tokens, self.prefill_seqs,
                                                            self.prefill_attention))

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in _FIELDS}


_FIELDS = ("prefill_tokens", "prefill_seqs", "decode_seqs", "sampled", "decode_context", "decode_padded",
           "prefill_attention", "decode_context_shared")
