"""cadence's AVX512-BF16 CPU kernels (model/cpu_kernels.py) against torch and float64 references.

On a CPU with AVX512-BF16 and a C compiler the kernels must build and load (a failure there is a
test failure, not a skip); elsewhere these tests are skipped with that reason, and the model runs
on torch ops, which the rest of the suite covers.
"""

from __future__ import annotations

import logging
import random
import shutil
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_model_tiny import ends_of, feed_in_chunks, hf_logits, random_tokens, tiny_hf, weights_of

from cadence.boundary import ScheduledRequest, SchedulerOutput
from cadence.executor.model_runner import ModelRunner
from cadence.model import cpu_kernels as ck
from cadence.model.attention import (
    AttentionMetadata,
    KernelPrefillChunk,
    PagedKVCache,
    SeqSpan,
    paged_attention,
)
from cadence.model.llama import Linear, apply_rope_, rope_tables
from cadence.request import SamplingParams

GREEDY_SP = SamplingParams(temperature=0.0, max_tokens=64)

CAN_BUILD = ck._cpu_has_avx512_bf16() and (shutil.which("cc") or shutil.which("gcc")) is not None
needs_kernels = pytest.mark.skipif(not CAN_BUILD, reason="CPU without AVX512-BF16 or no C compiler: torch ops run")


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)


@pytest.fixture(scope="module")
def kernels() -> ck.CpuKernels:
    k = ck.cpu_kernels()
    assert k is not None, "this CPU has AVX512-BF16 and a compiler: the kernels must build and pass the probe"
    return k


@needs_kernels
@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 6)])
def test_linear_matches_float64_and_is_batch_invariant(kernels, n, k):
    w, x = bf16(n, k, seed=1), bf16(13, k, seed=2)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    packed = kernels.pack(w)
    got = kernels.linear(x, packed, n, bias)
    want = x.double() @ w.double().T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (13, n)
    # float32 accumulation, one rounding to bfloat16 at the end: within bfloat16's half-ulp (2^-9).
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3 * k**0.5).all()
    torch.testing.assert_close(got, F.linear(x, w, bias.to(torch.bfloat16)), rtol=2e-2, atol=2e-2)
    # Every tile height (6-row tiles and the 1..5 remainders): each row bit-identical to itself alone.
    for m in range(1, 14):
        part = kernels.linear(x[:m], packed, n, bias)
        assert torch.equal(part, got[:m]), f"rows of a {m}-row batch differ from the 13-row batch"
    assert torch.equal(kernels.linear(x[7:8], packed, n, bias)[0], got[7])
    # Leading dimensions are kept; an empty batch is fine.
    assert torch.equal(kernels.linear(x.view(13, 1, k), packed, n, bias).squeeze(1), got)
    assert kernels.linear(x[:0], packed, n, None).shape == (0, n)


@needs_kernels
def test_linear_f32_is_linear_unrounded(kernels):
    """The logits' kernel: the same sums as `linear`, stored as float32 (rounding them gives
    `linear`'s output bit for bit), every row the same alone and batched."""
    w, x = bf16(100, 64, seed=20), bf16(13, 64, seed=21)
    packed = kernels.pack(w)
    got = kernels.linear_f32(x, packed, 100, None)
    assert got.dtype == torch.float32 and got.shape == (13, 100)
    assert torch.equal(got.to(torch.bfloat16), kernels.linear(x, packed, 100, None))
    assert ((got.double() - x.double() @ w.double().T).abs() <= 1e-4).all()
    for m in (1, 5, 6, 7):
        assert torch.equal(kernels.linear_f32(x[:m], packed, 100, None), got[:m])


def q4_1_matrix(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] matrix quantised by gguf's own Q4_1 code: (its blocks, uint8 [n, k/32*20];
    the float64 weights they stand for, d * q + m)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy() * 0.05
    raw = quantize(w.astype("float32"), GGMLQuantizationType.Q4_1)
    exact = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1).astype("float64"))
    return torch.from_numpy(raw.copy()).view(torch.uint8).reshape(n, -1), exact


@needs_kernels
@pytest.mark.parametrize("n,k", [(960, 576), (100, 64), (64, 1536), (17, 32)])
def test_q4_1_linear_matches_float64_and_is_batch_invariant(kernels, n, k):
    raw, w = q4_1_matrix(n, k, seed=6)
    x = bf16(40, k, seed=7)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(8))
    packed = kernels.pack_q4_1(raw, n, k)
    got = kernels.linear_q4_1(x, packed, n, bias)
    want = x.double() @ w.T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (40, n)
    # The checkpoint's exact weights, float32 sums, one rounding to bfloat16 at the end.
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-3 * k**0.5).all()
    # Small batches (3-row tiles over 64 columns) and large ones (6-row tiles over 32 columns, from
    # 12 rows): every row bit-identical whatever the batch.
    for m in (1, 2, 3, 4, 5, 11, 12, 13, 17, 25, 39):
        assert torch.equal(kernels.linear_q4_1(x[:m], packed, n, bias), got[:m]), f"{m}-row batch differs"
    assert torch.equal(kernels.linear_q4_1(x[29:30], packed, n, bias)[0], got[29])
    assert kernels.linear_q4_1(x[:0], packed, n, None).shape == (0, n)


@needs_kernels
def test_q4_1_linear_layer_and_its_switch(kernels, monkeypatch):
    raw, w = q4_1_matrix(96, 64, seed=9)
    layer = Linear(w.to(torch.bfloat16), None, raw)
    assert layer.q4_1 is not None and layer.packed is None and layer.weight is None
    x = bf16(5, 64, seed=10)
    assert torch.equal(layer(x), kernels.linear_q4_1(x, layer.q4_1, 96, None))
    assert Linear(w.float(), None, raw).q4_1 is None  # float32 keeps torch's path
    monkeypatch.setenv("CADENCE_Q4_KERNELS", "0")
    off = Linear(w.to(torch.bfloat16), None, raw)
    assert off.q4_1 is None and off.packed is not None  # the dequantised bfloat16 weight, as before
    torch.testing.assert_close(off(x), layer(x), rtol=2e-2, atol=2e-2)
    with pytest.raises(AssertionError):
        kernels.pack_q4_1(raw[:, :-1], 96, 64)  # not whole blocks


@needs_kernels
def test_linear_layer_uses_the_kernel_for_bfloat16_only(kernels):
    w = bf16(128, 64, seed=4)
    assert Linear(w).kernel is kernels and Linear(w).weight is None  # only the packed copy is kept
    assert Linear(w.float()).kernel is None  # float32 keeps torch's path (the parity tests' dtype)
    x = bf16(5, 64, seed=5)
    torch.testing.assert_close(Linear(w)(x), F.linear(x, w), rtol=2e-2, atol=2e-2)


@needs_kernels
@pytest.mark.parametrize("e", [576, 64, 40])
def test_add_rms_norm_matches_torch(kernels, e):
    x, delta, w = bf16(9, e, seed=6, scale=3.0), bf16(9, e, seed=7), bf16(e, seed=8, scale=0.5)
    want_x = x + delta  # torch's bfloat16 add: the residual must be exactly that
    h = want_x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)  # HF's LlamaRMSNorm
    got_x = x.clone()
    got = kernels.add_rms_norm(got_x, delta, w, 1e-5)
    assert torch.equal(got_x, want_x)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert (got != want).float().mean() < 0.02  # rare one-ulp differences (sqrt vs rsqrt), not a drift
    # Without delta: norm only, residual untouched; each row independent of the others.
    alone = kernels.add_rms_norm(want_x[4:5].clone(), None, w, 1e-5)
    assert torch.equal(alone[0], kernels.add_rms_norm(want_x.clone(), None, w, 1e-5)[4])
    with pytest.raises(AssertionError):
        kernels.add_rms_norm(x.float(), None, w, 1e-5)  # the C code trusts its pointers: types checked


@needs_kernels
def test_silu_mul_matches_torch_including_extremes(kernels):
    gu = bf16(5, 2 * 72, seed=9, scale=4.0)
    gu[0, :8] = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, -1e-3])
    got = kernels.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (5, 72) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)


@needs_kernels
def test_rope_matches_torch_and_leaves_other_heads(kernels):
    from cadence.model.arch import ModelArchConfig

    arch = ModelArchConfig(architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
                           max_position_embeddings=512, tie_word_embeddings=True, attention_bias=False)
    cos, sin = rope_tables(arch, torch.device("cpu"))
    qkv = bf16(7, 8, 16, seed=10)
    positions = torch.tensor([0, 1, 5, 100, 511, 3, 2])
    want = qkv.float()
    apply_rope_(want[:, :6], cos[positions][:, None], sin[positions][:, None])  # float32 reference
    got = qkv.clone()
    kernels.rope_(got, 6, positions, cos, sin)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # one bfloat16 rounding
    assert torch.equal(got[:, 6:], qkv[:, 6:])  # v heads untouched


@needs_kernels
def test_bfloat16_model_same_with_and_without_kernels(kernels, monkeypatch):
    """The tiny model in bfloat16 through the kernels and through torch ops (kernels disabled), both
    close to the float32 reference and to each other."""
    hf, arch = tiny_hf()
    tokens = random_tokens(20, seed=8)
    ref = hf_logits(hf, tokens)[ends_of([12], 20)]

    def run() -> torch.Tensor:
        runner = ModelRunner(arch, weights_of(hf), dtype=torch.bfloat16, device="cpu")
        runner.initialize_kv_cache(16, 4)
        return torch.stack(feed_in_chunks(runner, tokens, [12], [3, 1, 4, 0, 5]))

    with_kernels = run()
    monkeypatch.setattr(ck, "cpu_kernels", lambda: None)
    monkeypatch.setattr("cadence.model.llama.cpu_kernels", lambda: None)
    without = run()
    scale = ref.abs().max().item()
    for got in (with_kernels, without):
        assert (got - ref).abs().max().item() < 0.1 * scale
    assert (with_kernels - without).abs().max().item() < 0.1 * scale


def test_disabled_or_unbuildable_falls_back_with_a_reason(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        with caplog.at_level(logging.INFO, logger="cadence.model"):
            ck.cpu_kernels.cache_clear()
            monkeypatch.setenv("CADENCE_CPU_KERNELS", "0")
            assert ck.cpu_kernels() is None
            assert "disabled by CADENCE_CPU_KERNELS=0" in caplog.text
            if CAN_BUILD:  # a compiler that fails: no library, the reason logged, no exception
                ck.cpu_kernels.cache_clear()
                monkeypatch.delenv("CADENCE_CPU_KERNELS")
                monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
                assert ck.cpu_kernels() is None
                assert "build failed" in caplog.text
                assert not list(tmp_path.rglob("*.so"))  # no half-written library left to load
    finally:
        ck.cpu_kernels.cache_clear()  # later tests build (or find) the real library again


@needs_kernels
@pytest.mark.parametrize("kvh,g,d,bs", [(2, 2, 32, 4), (3, 3, 64, 16), (1, 8, 64, 16), (2, 1, 128, 8)])
def test_paged_decode_attention_matches_float64(kernels, kvh, g, d, bs):
    """The decode kernel reads contexts in place through block tables (lengths across block and
    16-position chunk edges), q strided as a view of the fused qkv output, after a prefill chunk in
    the same flat batch; against a per-request float64 softmax."""
    lengths = [1, 5, 17, 16, 33, 300, 2, 64]
    gen = torch.Generator().manual_seed(0)
    nblocks = sum(-(-n // bs) for n in lengths) + 8
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=nblocks, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    pool = random.Random(1).sample(range(nblocks), nblocks)
    tables, start = [], 0
    for n in [*lengths, 3]:
        tables.append(pool[start : start + -(-n // bs)])
        start += len(tables[-1])
    spans = [SeqSpan(0, 3, tables[-1])] + [SeqSpan(n - 1, 1, t) for n, t in zip(lengths, tables, strict=False)]
    meta = AttentionMetadata.build(spans, bs, torch.device("cpu"), num_kv_heads=kvh, kernels=kernels)
    assert len(meta.decodes) == 1 and meta.decodes[0].num_rows == len(lengths)
    t = 3 + len(lengths)
    qkv = torch.randn(t, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    out = paged_attention(q, kv_new, cache.layer(0), meta)
    layer = cache.layer(0).double()
    for i, (n, table) in enumerate(zip(lengths, tables, strict=False)):
        pos = torch.arange(n)
        ctx = layer[:, :, torch.tensor(table)[pos // bs], pos % bs]  # [2, KVH, n, D]
        for head in range(kvh * g):
            k, v = ctx[0, head // g], ctx[1, head // g]
            p = torch.softmax(k @ q[3 + i, head].double() / d**0.5, dim=0)
            torch.testing.assert_close(out[3 + i, head].double(), p @ v, atol=2e-2, rtol=0)
    # A row's output is the same alone: nothing in the kernel depends on the other rows.
    one = AttentionMetadata.build([SeqSpan(lengths[5] - 1, 1, tables[5])], bs, torch.device("cpu"),
                                  num_kv_heads=kvh, kernels=kernels)
    alone = paged_attention(q[8:9], kv_new[8:9], cache.layer(0), one)
    assert torch.equal(alone[0], out[8])


@needs_kernels
@needs_kernels
@pytest.mark.parametrize("kvh,g,d,bs", [(2, 2, 32, 4), (3, 3, 64, 16), (1, 8, 64, 16), (2, 1, 128, 8)])
def test_paged_prefill_attention_matches_float64_and_chunking(kernels, kvh, g, d, bs):
    """The prefill kernel: chunks of two requests (a fresh prompt, and a chunk continuing a context
    across block and 16-key edges) plus a decode row in one flat batch, read in place through
    shuffled block tables, against a per-query float64 causal softmax; and a prompt's rows are
    bit-identical whether it is computed in one chunk or in several (chunked prefill changes nothing)."""
    gen = torch.Generator().manual_seed(2)
    total = 75  # the continuing request's context: 41 earlier positions, then a 34-token chunk
    nblocks = 2 * -(-total // bs) + 8
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=nblocks, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=torch.bfloat16, device=torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    pool = random.Random(3).sample(range(nblocks), nblocks)
    fresh_t, cont_t, dec_t = pool[:6], pool[6 : 6 + -(-total // bs)], pool[-2:]
    spans = [SeqSpan(0, 21, fresh_t[: -(-21 // bs)]), SeqSpan(41, 34, cont_t), SeqSpan(4, 1, dec_t)]
    cpu = torch.device("cpu")
    meta = AttentionMetadata.build(spans, bs, cpu, num_kv_heads=kvh, kernels=kernels)
    assert all(isinstance(p, KernelPrefillChunk) and p.kernels is kernels for p in meta.prefills)  # no mask
    qkv = torch.randn(56, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    out = paged_attention(q, kv_new, cache.layer(0), meta)
    layer = cache.layer(0).double()
    for row0, span in ((0, spans[0]), (21, spans[1])):
        for i in range(span.num_tokens):
            pos = torch.arange(span.start_pos + i + 1)
            ctx = layer[:, :, torch.tensor(span.block_table)[pos // bs], pos % bs]
            for head in range(kvh * g):
                p = torch.softmax(ctx[0, head // g] @ q[row0 + i, head].double() / d**0.5, dim=0)
                torch.testing.assert_close(out[row0 + i, head].double(), p @ ctx[1, head // g], atol=2e-2, rtol=0)
    # The continuing chunk again, split 5 + 13 + 16 (the cache already holds its K/V): same bits.
    parts, start = [], 41
    for n in (5, 13, 16):
        m = AttentionMetadata.build([SeqSpan(start, n, cont_t)], bs, cpu, num_kv_heads=kvh, kernels=kernels)
        rows = slice(21 + start - 41, 21 + start - 41 + n)
        parts.append(paged_attention(q[rows], kv_new[rows], cache.layer(0), m))
        start += n
    assert torch.equal(torch.cat(parts), out[21:55])


def test_build_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    """An unwritable cache (here a path under a regular file) must not cost the kernels."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(ck, "_cache_dir", lambda: blocker / "kernels")
    monkeypatch.setattr(ck.tempfile, "gettempdir", lambda: str(tmp_path))
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    built = ck._build(compiler)
    assert built.parent.parent == tmp_path and built.exists()
    assert ck._build(compiler) == built  # found again, not rebuilt


@needs_kernels
def test_rope_positions_checked_before_the_kernel_reads_the_table(kernels):
    """The kernel indexes the RoPE tables unchecked: the model refuses a position past them, once per step."""
    from cadence.model.llama import LlamaModel

    hf, arch = tiny_hf()
    model = LlamaModel(arch, weights_of(hf), dtype=torch.bfloat16)
    assert isinstance(model.kernels, ck.CpuKernels)  # (a fresh load after the fallback test cleared the cache)
    rope = model.ops.rope_for(torch.tensor([0, model.cos.shape[0] - 1]))  # the last row is fine
    qkv = bf16(2, 8, 16, seed=11)
    rope(qkv, 6)
    with pytest.raises(ValueError, match="beyond the RoPE table"):
        model.ops.rope_for(torch.tensor([0, model.cos.shape[0]]))


def kernel_model(q4: bool, bias: bool, seed: int) -> tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(arch, weights, q4_1) of a random model the kernels take whole (head_dim 32): Llama, Qwen2 (a
    qkv bias), or with its projections as Q4_1 blocks (as the default GGUF model's); norms random."""
    from dataclasses import replace

    from cadence.engine.builder import random_weights
    from cadence.model.arch import ModelArchConfig

    arch = ModelArchConfig(architecture="qwen2" if bias else "llama", vocab_size=300, hidden_size=128,
                           intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                           rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
                           attention_bias=bias, rms_norm_eps=1e-6)
    weights = random_weights(replace(arch), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in list(weights):
        if "norm" in name:
            weights[name] = 1.0 + 0.2 * torch.randn(weights[name].shape, generator=g)
    if bias:
        for i in range(arch.num_layers):
            for part, rows in (("q", 128), ("k", 64), ("v", 64)):
                weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = 0.3 * torch.randn(rows, generator=g)
    q4_1 = {}
    if q4:
        for name, w in weights.items():
            if name.endswith("proj.weight"):
                raw, exact = q4_1_matrix(*w.shape, seed=len(q4_1))
                q4_1[name], weights[name] = raw, exact.float()
    return arch, weights, q4_1


def _fused_pair(q4: bool, bias: bool, kv_cache_dtype: str = "auto") -> tuple[ModelRunner, ModelRunner]:
    """Two runners on the same random model: one with all-decode steps in one `decode_layers` call,
    one layer by layer in Python."""
    arch, weights, q4_1 = kernel_model(q4, bias, seed=11)
    runners = tuple(ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, kv_cache_dtype=kv_cache_dtype)
                    for _ in range(2))
    assert runners[0].model.fused_decode is not None
    if q4:
        assert runners[0].model.layers[0].down.q4_1 is not None
    runners[1].model.fused_decode = None
    for r in runners:
        r.initialize_kv_cache(64, 4)
    return runners  # type: ignore[return-value]


@needs_kernels
@pytest.mark.parametrize("q4,bias,kv", [(False, False, "auto"), (True, False, "auto"), (False, True, "auto"),
                                         (False, False, "int8"), (True, False, "int8")])
def test_decode_layers_in_one_call_bit_identical(kernels, q4, bias, kv, monkeypatch):
    """Ragged contexts in shuffled blocks: a prefill step (layer by layer in both), then decode steps
    (one call in the first runner): every step's logits and the whole KV cache identical, bit for bit
    (with the 8-bit cache: the C quantises the decode rows' K/V to the bits torch's `quantize_kv` gives
    the prefill's)."""
    fused, plain = _fused_pair(q4, bias, kv)
    assert fused.kv_cache.kv.dtype == (torch.int8 if kv == "int8" else torch.bfloat16)
    calls = []
    real = fused.model.kernels.decode_layers
    monkeypatch.setattr(fused.model.kernels, "decode_layers", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = random.Random(13)
    free = rng.sample(range(64), 64)
    reqs = {f"r{i}": ([rng.randrange(300) for _ in range(n)], []) for i, n in enumerate((3, 9, 17, 1, 6))}
    for tokens, table in reqs.values():
        table.extend(free.pop() for _ in range(-(-(len(tokens) + 12) // 4)))
    pos = dict.fromkeys(reqs, 0)
    for step in range(12):
        scheduled = tuple(
            ScheduledRequest(rid, tuple(tokens[pos[rid]:]), pos[rid], tuple(table), True, GREEDY_SP)
            for rid, (tokens, table) in reqs.items())
        got = fused.compute_logits(SchedulerOutput(step, scheduled))
        want = plain.compute_logits(SchedulerOutput(step, scheduled))
        for rid, (tokens, _) in reqs.items():
            assert torch.equal(got[rid], want[rid]), f"step {step}, {rid}"
            pos[rid] = len(tokens)
            tokens.append(int(got[rid].argmax()))
    assert torch.equal(fused.kv_cache.kv, plain.kv_cache.kv)
    assert len(calls) == 11  # every step after the prefill, in the fused runner only
