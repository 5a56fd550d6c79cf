"""The real executor: runs the model over one step's flat batch and samples.

It knows the model, the paged KV tensors and the sampler; it knows nothing of HTTP, asyncio or the
scheduler's internals, only the frozen `SchedulerOutput` of each step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cadence.boundary import ModelOutput, ScheduledRequest, SchedulerOutput
from cadence.executor.drafter import Drafter
from cadence.model.arch import ModelArchConfig
from cadence.model.attention import KV_CACHE_DTYPES, AttentionMetadata, PagedKVCache, SeqSpan, to_device
from cadence.model.llama import INT8_TWO_TERMS, LlamaModel
from cadence.model.sampler import Sampler
from cadence.sched.features import verifications_run_as_decodes

log = logging.getLogger("cadence.executor")


@dataclass(frozen=True)
class FlatBatch:
    """One step's model inputs; `order` is the flat-batch order of the scheduled requests."""

    order: tuple[ScheduledRequest, ...]
    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] last row of each request that samples (every row of a verification row)
    sampling: tuple[ScheduledRequest, ...]  # the requests that sample, in logits row order
    has_drafts: bool = False  # some sampling request is a verification row: more logits rows than requests


class ModelRunner:
    """`Executor` over a Llama-family model and a paged KV cache.

    The cache is one tensor per K and V for all layers (see `PagedKVCache`), sized by the engine
    through `kv_bytes_per_block` and `initialize_kv_cache`.
    """

    # (These parameters repeat LlamaModel's on purpose: the runner builds the model from them.)
    def __init__(
        self,
        arch: ModelArchConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        q8_0: dict[str, torch.Tensor] | None = None,
        q4_0: dict[str, torch.Tensor] | None = None,
        activation_dtype: str = "auto",
        int8_two_terms: frozenset[str] = INT8_TWO_TERMS,
        seed: int = 0,
        q4_1: dict[str, torch.Tensor] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: {dtype} is not supported (float32, bfloat16, float16)")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        self.arch = arch
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype  # auto: K/V in `dtype`; int8: the 8-bit layout
        self.device = torch.device(device)
        self.model = LlamaModel(arch, weights, dtype=dtype, device=self.device, q4_1=q4_1, q8_0=q8_0,
                                q4_0=q4_0, activation_dtype=activation_dtype,
                                int8_two_terms=int8_two_terms)
        self.sampler = Sampler(self.device, seed)
        self.kv_cache: PagedKVCache | None = None
        # Speculative decoding with a draft model: proposes the next drafts after each step.
        self.drafter: Drafter | None = None
        # True where the block count was given (--num-kv-blocks) rather than derived from a memory figure.
        self.kv_blocks_given = False

    # -- Executor protocol ------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        """A block's bytes: the served model's K/V, and with a draft model its K/V for as many
        positions (the draft cache has as many blocks, `initialize_kv_cache`), so that the engine's
        block count keeps both within the KV cache memory."""
        target = PagedKVCache.bytes_per_block(
            num_layers=self.arch.num_layers,
            block_size=block_size,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        return target + (self.drafter.bytes_per_block() if self.drafter is not None else 0)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        if self.drafter is not None:
            self.drafter.initialize_cache(num_blocks)
            per_block = self.drafter.bytes_per_block()
            where = ("outside any memory figure (--num-kv-blocks gives the block count of both caches)"
                     if self.kv_blocks_given else "within the KV cache memory")
            log.info("draft model's KV cache: %d blocks of %d tokens, %.1f MiB, %s",
                     num_blocks, block_size, num_blocks * per_block / 2**20, where)
        self.kv_cache = PagedKVCache.allocate(
            num_layers=self.arch.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=self.arch.num_kv_heads,
            head_dim=self.arch.head_dim,
            dtype=self.dtype,
            device=self.device,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        result = self._execute(scheduler_output)
        return result if self.drafter is None else self.drafter.attach(scheduler_output, result)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if scheduler_output.is_empty:
            return ModelOutput()
        batch = self.prepare(scheduler_output.scheduled)
        with torch.inference_mode():
            logits = self._run(batch)
            if not batch.sampling:
                return ModelOutput()
            if batch.has_drafts:
                return self._verify_and_sample(logits, batch, scheduler_output)
            # The only host sync of the step: reading the sampled tokens back.
            sampled = self.sampler(logits, batch.sampling, _grammar_rows(scheduler_output, batch.sampling))
        ids = [r.request_id for r in batch.sampling]
        return ModelOutput(
            sampled_token_ids=dict(zip(ids, sampled.token_ids, strict=True)),
            logprobs={ids[i]: lp for i, lp in sampled.logprobs.items()},
        )

    def _verify_and_sample(self, logits: torch.Tensor, batch: FlatBatch, out: SchedulerOutput) -> ModelOutput:
        """A step with verification rows: each one's 1 + k logits rows verify its drafts (greedily,
        or by rejection sampling); the other requests sample from their one row as in any step."""
        plain: list[ScheduledRequest] = []
        plain_rows: list[int] = []
        verifying: list[tuple[ScheduledRequest, int]] = []
        row = 0
        for r in batch.sampling:
            if r.num_draft_tokens:
                verifying.append((r, row))
            else:
                plain.append(r)
                plain_rows.append(row)
            row += 1 + r.num_draft_tokens
        verified = self.sampler.verify(logits, verifying)
        if not plain:
            return ModelOutput(verified_token_ids=verified)
        index = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
        sampled = self.sampler(logits.index_select(0, index), plain, _grammar_rows(out, plain))
        ids = [r.request_id for r in plain]
        return ModelOutput(
            sampled_token_ids=dict(zip(ids, sampled.token_ids, strict=True)),
            logprobs={ids[i]: lp for i, lp in sampled.logprobs.items()},
            verified_token_ids=verified,
        )

    # -- KV blocks moved between engines ------------------------------------------------------------

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy of these blocks' K and V, every layer: `[num_layers, 2, num_kv_heads, n, block_size,
        head_dim]` on the CPU, in `block_ids` order (the 8-bit cache's: head_dim + 4 int8)."""
        assert self.kv_cache is not None
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.kv_cache.kv.device)
        return self.kv_cache.kv.index_select(3, index).cpu()

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite these blocks with `data` as `read_blocks` gives it (of another engine of the
        same model, dtype and block size)."""
        assert self.kv_cache is not None
        kv = self.kv_cache.kv
        expected = (*kv.shape[:3], len(block_ids), *kv.shape[4:])
        if tuple(data.shape) != expected or data.dtype != kv.dtype:
            raise ValueError(f"KV blocks of shape {tuple(data.shape)} {data.dtype}; this cache takes "
                             f"{expected} {kv.dtype}")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
        kv.index_copy_(3, index, data.to(kv.device))

    # -- Also used by tests and benchmarks --------------------------------------------------------

    def compute_logits(self, scheduler_output: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run the step (writing the KV cache) and return the float32 logits [V] of each sampling
        request; of a verification row, [1 + k, V]: one row per position."""
        batch = self.prepare(scheduler_output.scheduled)
        with torch.inference_mode():
            logits = self._run(batch)
        out: dict[str, torch.Tensor] = {}
        row = 0
        for r in batch.sampling:
            k = r.num_draft_tokens
            out[r.request_id] = logits[row : row + 1 + k] if k else logits[row]
            row += 1 + k
        return out

    def prepare(self, scheduled: Sequence[ScheduledRequest]) -> FlatBatch:
        """Lay the step out as one flat batch: multi-token chunks first, then the decode tokens, shortest
        context first, so decodes of similar length are contiguous slices attention batches together."""
        if self.kv_cache is None:
            raise RuntimeError("initialize_kv_cache must be called before execute")
        if not scheduled:
            raise ValueError("a step needs at least one scheduled request")
        self._validate(scheduled)
        # Chunks first in the given order, then decodes by context length, so attention can group
        # decodes of similar lengths (model/attention.py, `decode_groups`).
        order = tuple(sorted(scheduled, key=lambda r: (r.num_tokens == 1, r.end_pos if r.num_tokens == 1 else 0)))
        ids: list[int] = []
        last_rows: list[int] = []
        has_drafts = False
        for r in order:
            ids.extend(r.token_ids)
            if r.sample:
                if r.num_draft_tokens:  # every position of a verification row has its logits
                    has_drafts = True
                    last_rows.extend(range(len(ids) - 1 - r.num_draft_tokens, len(ids)))
                else:
                    last_rows.append(len(ids) - 1)
        spans = self._spans(order, has_drafts)
        meta = AttentionMetadata.build(spans, self.kv_cache.block_size, self.device, self.arch.num_kv_heads,
                                       self.model.decode_kernels)
        return FlatBatch(
            order=order,
            input_ids=to_device(torch.tensor(ids, dtype=torch.long), self.device),
            meta=meta,
            logits_indices=to_device(torch.tensor(last_rows, dtype=torch.long), self.device),
            sampling=tuple(r for r in order if r.sample),
            has_drafts=has_drafts,
        )

    def _spans(self, order: Sequence[ScheduledRequest], has_drafts: bool) -> list[SeqSpan]:
        """The step's attention spans. Where the model runs all-decode steps in one kernel call and
        every row is a decode or a verification row, a verification row of 1 + k tokens from
        position p becomes k + 1 single-token decode rows at p .. p + k sharing its block table
        (context lengths p + 1 .. p + k + 1): the kernel writes every row's K/V of a layer before
        any row of that layer attends, and a decode query computes the bits a chunk's query at
        that position does, so the step takes the one-call path with the same logits."""
        if has_drafts and self.model.fused_decode is not None and verifications_run_as_decodes(order):
            return [SeqSpan(r.start_pos + i, 1, r.block_table) for r in order for i in range(r.num_tokens)]
        return [SeqSpan(r.start_pos, r.num_tokens, r.block_table) for r in order]

    def _run(self, batch: FlatBatch) -> torch.Tensor:
        assert self.kv_cache is not None
        return self.model(batch.input_ids, batch.meta, self.kv_cache, batch.logits_indices)

    def _validate(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Bad indices would corrupt other requests' cache or crash inside a kernel: check up front."""
        assert self.kv_cache is not None
        num_blocks = self.kv_cache.num_blocks
        max_pos = self.model.cos.shape[0]
        vocab = self.arch.vocab_size
        for r in scheduled:
            if not r.token_ids:
                raise ValueError(f"request {r.request_id}: no tokens scheduled")
            if r.end_pos > max_pos:
                raise ValueError(f"request {r.request_id}: position {r.end_pos - 1} beyond the RoPE table ({max_pos})")
            if min(r.token_ids) < 0 or max(r.token_ids) >= vocab:
                raise ValueError(f"request {r.request_id}: token id outside the vocabulary [0, {vocab})")
            if r.block_table and (min(r.block_table) < 0 or max(r.block_table) >= num_blocks):
                raise ValueError(f"request {r.request_id}: block id outside [0, {num_blocks})")


def _grammar_rows(out: SchedulerOutput, sampling: Sequence[ScheduledRequest]) -> tuple[list[int], torch.Tensor] | None:
    """The step's grammar bitmask with the logits row of each of its requests."""
    mask = out.grammar
    if mask is None:
        return None
    row = {r.request_id: i for i, r in enumerate(sampling)}
    return [row[rid] for rid in mask.request_ids], mask.bitmask
