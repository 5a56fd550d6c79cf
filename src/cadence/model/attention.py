"""Paged KV cache storage and attention over it.

The cache holds K and V for every layer in fixed-size blocks. A token at position `pos` of a
request lives in slot `block_table[pos // block_size] * block_size + pos % block_size`; a request's
context is read back by gathering the slots of positions `0 .. end_pos - 1`.

Layout, per layer: `[2, num_kv_heads, num_blocks, block_size, head_dim]` (K/V outermost, then the
head, then the block). Contexts are read back a whole block at a time: gathering a request's blocks
along the block axis yields, for each head, its context as one contiguous [L, head_dim] matrix, so
attention runs as a strided-batch matmul with no transposing copy, and each gathered row is a whole
block (block_size * head_dim values) rather than one token. Positions past a request's length in its
last block are masked. (A slot-major layout needs a [L, heads, D] -> [heads, L, D] copy per layer,
and per-token gathers move 16x more, smaller rows: both cost more than the attention itself.)

Everything that depends only on the step's shape (slot mapping, gather indices, masks) is built once
per step in `AttentionMetadata.build` and reused by every layer, so the per-layer work is tensor ops
only: one `index_copy_` to write the new K/V, one `scaled_dot_product_attention` per multi-token
chunk, and one batched attention per group of single-token (decode) rows. Whether attention runs
on torch ops (`TorchAttention`) or on cadence's CPU kernels (`KernelAttention`) is chosen in one
place, `attention_backend`; the backend builds the step's parts, and each part attends by itself.

Decode rows are grouped by context length. One batched matmul pads every context to the longest:
with 32 chat streams and one 600-token answer among 100-token ones, that is 5x the work, and it was
the largest cost of a served step. Each extra group costs a fixed few ops per layer, so
`decode_groups` splits the (sorted) lengths where the padding saved outweighs that overhead.

bfloat16 on a CPU with AVX512-BF16: decode rows skip all of that. cadence's decode kernel
(model/cpu_kernels.py) reads each context where it lies, block by block through the block table,
with an online softmax: no gather copy, no padding, no groups (`PagedDecode`), 1.5x the step
throughput at 8 and 32 streams of 200-token contexts. Prefill chunks go to its prefill kernel the
same way (`KernelPrefillChunk`): no gather, no mask. Both kernels compute a query by one
arithmetic (keys in 16-position chunks from position 0, the same summation order throughout), so a
position's attention output, and with it its hidden state, K/V and logits, are the same bits in a
prefill, in any chunking of it, in a decode step and in a recompute after preemption.

The 8-bit cache (`--kv-cache-dtype int8`): each slot of a KV head holds its token's D values as int8
followed by their float32 scale, D + 4 bytes instead of 2 D (`quantize_kv`). A token is quantised
alone, per KV head, when its K/V is written, and never again: its stored bits depend on its own K/V
only, so the exactness above holds with the 8-bit cache too. The kernels read it in place
(dequantising in registers); the torch path dequantises what it gathers (`dequantize_kv`), and a
first prefill chunk attends to its own K/V as stored, quantised, like every later read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.config import KV_CACHE_DTYPES
from cadence.model.cpu_kernels import KV8_SCALE_BYTES, CpuKernels

# Decode groups of up to this many (KV head, request) pairs, e.g. 10 streams with 3 KV heads, go
# through torch's fused attention kernel: measured 1.5x (8 streams) to 5x (one stream) faster on
# CPU than separate matmuls and softmax, whose per-op costs dominate small groups. For larger groups
# the two batched matmuls win (1.3x to 1.7x at 24 and 32 streams).
_FUSED_MAX_BATCH = 32

# The fixed cost of one more decode group (a gather, two batched matmuls, a softmax per layer),
# in units of padded (request x block) cells: measured on CPU, a group's ops cost about what
# attending 64 more blocks of context does.
GROUP_OVERHEAD_BLOCKS = 64

def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., D] -> the 8-bit cache's slots [..., D + 4] int8: each row's values as int8
    q = x / scale rounded to the nearest integer (ties to even), scale = max|x| / 127 (a row of
    zeros: scale 0), then the scale's float32 bytes. The C kernels' `quantize_row_kv8` gives the
    same bits: a token's stored K/V is a function of its own K/V alone."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(xf / scale), 0.0).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize_kv(slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 8-bit cache's slots [..., D + 4] -> [..., D] in `dtype` (q * scale, in float32 first)."""
    d = slots.shape[-1] - KV8_SCALE_BYTES
    scale = slots[..., d:].contiguous().view(torch.float32)
    return (slots[..., :d].float() * scale).to(dtype)


def kv_slot_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one token's K (or V) of one KV head in the cache."""
    if kv_cache_dtype == "int8":
        return head_dim + KV8_SCALE_BYTES
    return head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class PagedKVCache:
    """K and V of all layers: `[num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]` in the
    model's dtype, or the 8-bit cache's int8 `[..., head_dim + 4]` (`quantize_kv`)."""

    kv: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> PagedKVCache:
        """`dtype`: the model's; `kv_cache_dtype` int8: the 8-bit layout, int8 slots of head_dim + 4."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size})")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        kv8 = kv_cache_dtype == "int8"
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim + (KV8_SCALE_BYTES if kv8 else 0))
        # Zeros, not empty: padded decode rows read slot 0 (masked out), and garbage there could be
        # NaN/inf, which survives a -inf mask as NaN after softmax's 0 * nan. (A zero 8-bit slot
        # reads as zeros, scale 0.)
        return cls(torch.zeros(shape, dtype=torch.int8 if kv8 else dtype, device=device))

    @staticmethod
    def bytes_per_block(
        *, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        kv_cache_dtype: str = "auto",
    ) -> int:
        return 2 * num_layers * block_size * num_kv_heads * kv_slot_bytes(head_dim, dtype, kv_cache_dtype)

    @property
    def is_8bit(self) -> bool:
        return self.kv.dtype == torch.int8

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[3]

    @property
    def block_size(self) -> int:
        return self.kv.shape[4]

    def layer(self, i: int) -> torch.Tensor:
        """Layer i: `[2, num_kv_heads, num_blocks, block_size, head_dim]`."""
        return self.kv[i]


@dataclass(frozen=True)
class SeqSpan:
    """One request's share of the flat batch: `num_tokens` tokens fed from `start_pos`."""

    start_pos: int
    num_tokens: int
    block_table: Sequence[int]

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class PrefillChunk:
    """A multi-token chunk on torch ops: rows `row_start .. row_end` of the flat batch."""

    row_start: int
    row_end: int
    start_pos: int
    ctx_blocks: torch.Tensor | None  # [nb] blocks holding the whole context; None when start_pos == 0
    mask: torch.Tensor | None  # [num_tokens, nb * block_size] bool, True = may attend; None when start_pos == 0

    def attend(self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """Causal attention of the chunk's queries. Returns [n, H, D]."""
        qc = q[self.row_start : self.row_end].transpose(0, 1)[None]  # [1, H, n, D]
        if self.ctx_blocks is None:
            # The chunk is the whole context: attend to its own fresh K/V, plain causal, no gather.
            ctx = kv[self.row_start : self.row_end].permute(1, 2, 0, 3)  # [2, KVH, n, D]
            o = F.scaled_dot_product_attention(qc, ctx[0][None], ctx[1][None], is_causal=True, enable_gqa=True)
        else:
            ctx = _gather_blocks(cache, self.ctx_blocks, q.dtype)  # [2, KVH, nb * bs, D]
            o = F.scaled_dot_product_attention(qc, ctx[0][None], ctx[1][None], attn_mask=self.mask, enable_gqa=True)
        return o[0].transpose(0, 1)


@dataclass(frozen=True)
class KernelPrefillChunk:
    """A multi-token chunk on cadence's CPU prefill kernel, which reads the context in place through
    `ctx_blocks` (no gather, no mask)."""

    row_start: int
    row_end: int
    start_pos: int
    ctx_blocks: torch.Tensor  # [nb] blocks holding the whole context, this chunk included
    kernels: CpuKernels

    def attend(self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return self.kernels.prefill_attention(q[self.row_start : self.row_end], cache, self.ctx_blocks, self.start_pos)


@dataclass(frozen=True)
class DecodeBatch:
    """A group of single-token rows on torch ops, contiguous in the flat batch: rows
    `row_start .. + num_rows`."""

    row_start: int
    num_rows: int
    num_blocks: int  # nb: blocks gathered per request (the longest context's)
    blocks: torch.Tensor  # [B * nb] block ids, request-major; padding points at block 0 (masked)
    fused: bool  # through the fused attention kernel (small groups) rather than two batched matmuls
    # None: nothing to mask. Fused: bool [KVH * B, 1, 1, L], True = may attend; otherwise float32
    # additive [KVH * B, 1, L] (L = nb * block_size), as each path takes it.
    mask: torch.Tensor | None

    def attend(self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return _decode_attention(q[self.row_start : self.row_start + self.num_rows], cache, self)


@dataclass(frozen=True)
class PagedDecode:
    """All single-token rows at once, for cadence's CPU decode kernel, which reads each context
    where it lies in the paged cache: no grouping, no padding, no gather."""

    row_start: int
    num_rows: int
    tables: torch.Tensor  # [B, W] int64 block ids (zero-padded past each request's blocks)
    lens: torch.Tensor  # [B] int64 context lengths, this step's token included
    total_len: int
    kernels: CpuKernels

    def attend(self, q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        rows = q[self.row_start : self.row_start + self.num_rows]
        return self.kernels.decode_attention(rows, cache, self.tables, self.lens, self.total_len)


class TorchAttention:
    """Attention on torch ops: prefill chunks through `scaled_dot_product_attention` (a gathered
    context and a mask past position 0), decode rows in groups by context length (`decode_groups`)."""

    def __init__(self, block_size: int, device: torch.device, num_kv_heads: int) -> None:
        self.block_size, self.device, self.num_kv_heads = block_size, device, num_kv_heads

    def prefill(self, s: SeqSpan, row: int, table: torch.Tensor) -> PrefillChunk:
        if s.start_pos == 0:
            # The chunk is the whole context: attend to its own fresh K/V, plain causal, no gather.
            return PrefillChunk(row, row + s.num_tokens, 0, None, None)
        nb = -(-s.end_pos // self.block_size)
        # Query i sits at position start_pos + i and sees keys 0 .. start_pos + i (bottom-right causal);
        # that also hides the unused tail of the last block.
        q_pos = torch.arange(s.start_pos, s.end_pos)[:, None]
        mask = torch.arange(nb * self.block_size)[None, :] <= q_pos
        return PrefillChunk(
            row, row + s.num_tokens, s.start_pos, to_device(table[:nb], self.device), to_device(mask, self.device)
        )

    def decodes(self, seqs: Sequence[SeqSpan], row: int, tables: torch.Tensor) -> tuple[DecodeBatch, ...]:
        nbs = [-(-s.end_pos // self.block_size) for s in seqs]
        return tuple(_decode_batch(seqs[lo:hi], row + lo, tables[lo:hi], self.block_size, self.device,
                                   self.num_kv_heads) for lo, hi in decode_groups(nbs))


class KernelAttention:
    """Attention on cadence's bfloat16 CPU kernels: each prefill chunk and all decode rows at once
    read their contexts where they lie in the paged cache."""

    def __init__(self, block_size: int, kernels: CpuKernels) -> None:
        self.block_size, self.kernels = block_size, kernels

    def prefill(self, s: SeqSpan, row: int, table: torch.Tensor) -> KernelPrefillChunk:
        nb = -(-s.end_pos // self.block_size)
        return KernelPrefillChunk(row, row + s.num_tokens, s.start_pos, table[:nb].contiguous(), self.kernels)

    def decodes(self, seqs: Sequence[SeqSpan], row: int, tables: torch.Tensor) -> tuple[PagedDecode, ...]:
        if not seqs:
            return ()
        lens = [s.end_pos for s in seqs]
        return (PagedDecode(row, len(seqs), tables.contiguous(), torch.tensor(lens), sum(lens), self.kernels),)


def attention_backend(block_size: int, device: torch.device, num_kv_heads: int,
                      kernels: CpuKernels | None) -> TorchAttention | KernelAttention:
    """The one choice between cadence's kernels and torch for attention: the kernels where the
    model was given them (bfloat16 on a CPU that has them), torch otherwise."""
    return KernelAttention(block_size, kernels) if kernels is not None else TorchAttention(block_size, device, num_kv_heads)


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] position of each token of the flat batch
    slot_mapping: torch.Tensor  # [T] cache slot each new K/V is written to
    prefills: tuple[PrefillChunk | KernelPrefillChunk, ...]  # the multi-token chunks, in row order
    decodes: tuple[DecodeBatch, ...] | tuple[PagedDecode, ...]  # the single-token rows, in row order
    # cadence's CPU kernels where attention runs on them: they also write K/V into the 8-bit cache.
    kernels: CpuKernels | None = None

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSpan],
        block_size: int,
        device: torch.device,
        num_kv_heads: int,
        kernels: CpuKernels | None = None,
    ) -> AttentionMetadata:
        """Index tensors for one step. Multi-token spans must come before single-token ones; single-token
        spans sorted by length group best (any order is correct). With `kernels` (bfloat16 on a CPU
        that has them), decode rows go to the paged decode kernel instead of batched torch ops."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        tables = _padded_block_tables(seqs, block_size)  # [R, max_blocks] on CPU
        positions = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in seqs])
        seq_of_token = torch.repeat_interleave(
            torch.arange(len(seqs)), torch.tensor([s.num_tokens for s in seqs])
        )
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

        backend = attention_backend(block_size, device, num_kv_heads, kernels)
        first_decode = next((i for i, s in enumerate(seqs) if s.num_tokens == 1), len(seqs))
        row, prefills = 0, []
        for i, s in enumerate(seqs[:first_decode]):
            prefills.append(backend.prefill(s, row, tables[i]))
            row += s.num_tokens
        decode_seqs = seqs[first_decode:]
        assert all(s.num_tokens == 1 for s in decode_seqs), "single-token spans must come last"
        return cls(
            positions=to_device(positions, device),
            slot_mapping=to_device(slot_mapping, device),
            prefills=tuple(prefills),
            decodes=backend.decodes(decode_seqs, row, tables[first_decode:]),
            kernels=backend.kernels if isinstance(backend, KernelAttention) else None,
        )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host-built index tensors to the model's device. On CUDA through pinned memory, so the copy is
    asynchronous and the step's kernels queue behind it without a host sync; on CPU, a no-op."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def decode_groups(nbs: Sequence[int], overhead: int = GROUP_OVERHEAD_BLOCKS) -> list[tuple[int, int]]:
    """Split rows 0..n into consecutive groups [lo, hi) minimising the padded work
    sum(overhead + rows * max blocks) over groups. `nbs`: blocks per row, best sorted ascending.

    An exact dynamic programme over the runs of equal lengths (a split inside a run never helps),
    so sorted input costs O(distinct lengths ^ 2), once per step. Unsorted input still yields valid
    groups, only less tight ones.
    """
    runs: list[int] = []  # start row of each run of equal nbs
    for i, nb in enumerate(nbs):
        if i == 0 or nb != nbs[i - 1]:
            runs.append(i)
    n, m = len(nbs), len(runs)
    bounds = [*runs, n]
    best = [0] * (m + 1)  # best[j]: cost of the rows before run j
    cut = [0] * (m + 1)
    for j in range(1, m + 1):  # the last group ends with run j - 1
        top, best[j] = 0, -1
        for i in range(j - 1, -1, -1):  # ... and starts with run i
            top = max(top, nbs[runs[i]])
            cost = best[i] + overhead + (bounds[j] - bounds[i]) * top
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], m
    while j > 0:
        groups.append((bounds[cut[j]], bounds[j]))
        j = cut[j]
    return groups[::-1]


def _padded_block_tables(seqs: Sequence[SeqSpan], block_size: int) -> torch.Tensor:
    """[R, max_blocks] block ids; a table too short for its span is a caller error."""
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s.num_tokens < 1 or s.start_pos < 0:
            raise ValueError(f"sequence {i}: needs num_tokens >= 1 and start_pos >= 0")
        if len(s.block_table) * block_size < s.end_pos:
            raise ValueError(
                f"sequence {i}: block table of {len(s.block_table)} blocks cannot hold {s.end_pos} tokens"
            )
        if s.block_table:
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.long)
    return tables


def _decode_batch(
    seqs: Sequence[SeqSpan], row: int, tables: torch.Tensor, block_size: int, device: torch.device, kvh: int
) -> DecodeBatch:
    lens = torch.tensor([s.end_pos for s in seqs])
    nb = -(-int(lens.max()) // block_size)
    blocks = tables[:, :nb]  # [B, nb]; shorter tables are zero-padded: block 0, masked below
    valid = torch.arange(nb * block_size)[None, :] < lens[:, None]  # [B, nb * block_size]
    fused = kvh * len(seqs) <= _FUSED_MAX_BATCH
    mask = None
    if not bool(valid.all()):
        allowed = valid.repeat(kvh, 1)[:, None, :]  # [KVH * B, 1, L], head-major like the batch
        mask = allowed[:, None] if fused else torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        mask = to_device(mask, device)
    return DecodeBatch(row, len(seqs), nb, to_device(blocks.flatten(), device), fused, mask)


def paged_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend every query to its request's context.

    q: [T, H, D]; kv: [T, 2, KVH, D] (K already rotated); cache: [2, KVH, num_blocks, block_size, D]
    (one layer, or the 8-bit layout's int8 [.., D + 4]: K/V quantised on the way in, and attended
    to as stored). Returns [T, H, D].
    """
    if cache.dtype == torch.int8 and meta.kernels is not None:
        # One C call quantises every row into its slot (the bits `quantize_kv` gives): torch's
        # quantisation and copy take about ten ops a layer. The kernels read the cache in place,
        # a first chunk's own K/V too.
        meta.kernels.store_kv8(kv, meta.slot_mapping, cache)
        stored = kv
    else:
        stored = quantize_kv(kv) if cache.dtype == torch.int8 else kv  # [T, 2, KVH, D (+ 4)]
        cache.flatten(2, 3).index_copy_(2, meta.slot_mapping, stored.permute(1, 2, 0, 3))
    if stored is not kv and any(isinstance(p, PrefillChunk) and p.ctx_blocks is None for p in meta.prefills):
        kv = dequantize_kv(stored, kv.dtype)  # a first chunk reads its own K/V as a later step would
    parts = [p.attend(q, kv, cache) for p in meta.prefills]
    parts += [d.attend(q, kv, cache) for d in meta.decodes]
    # One part (a lone prefill, or decodes only) is the common case: no concatenation copy.
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[2, KVH, num_blocks, bs, D] -> [2, KVH, len(blocks) * bs, D]: contexts, contiguous per head,
    in `dtype` (the 8-bit cache's slots dequantised)."""
    ctx = cache.index_select(2, blocks).flatten(2, 3)
    return dequantize_kv(ctx, dtype) if ctx.dtype == torch.int8 else ctx


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, d: DecodeBatch) -> torch.Tensor:
    """One query per request, all requests of the group at once. q: [B, H, D] -> [B, H, D].

    The G = H / KVH query heads sharing a KV head become G query rows of that head's attention, so
    K/V are never repeated. Scores and softmax are float32 whatever the model dtype.
    """
    b, h, dim = q.shape
    kvh = cache.shape[1]
    ctx = _gather_blocks(cache, d.blocks, q.dtype)  # [2, KVH, B * L, D], L = nb * block_size
    k = ctx[0].view(kvh * b, -1, dim)  # [KVH*B, L, D], batch index = head * B + request
    v = ctx[1].view(kvh * b, -1, dim)
    # Head j*G + g uses KV head j (grouped-query attention): [B, H, D] -> [KVH*B, G, D].
    qg = q.view(b, kvh, h // kvh, dim).transpose(0, 1).reshape(kvh * b, h // kvh, dim)
    if d.fused:
        # One fused kernel (scores, softmax and the weighted sum in float32 internally), one "head"
        # of G query rows per (KV head, request).
        o = F.scaled_dot_product_attention(qg[:, None], k[:, None], v[:, None], attn_mask=d.mask)[:, 0]
    else:
        scores = torch.bmm(qg, k.transpose(1, 2)).float().mul_(dim**-0.5)  # [KVH*B, G, L]
        if d.mask is not None:
            scores.add_(d.mask)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.bmm(probs, v).to(q.dtype)  # [KVH*B, G, D]
    return o.view(kvh, b, h // kvh, dim).transpose(0, 1).reshape(b, h, dim)
