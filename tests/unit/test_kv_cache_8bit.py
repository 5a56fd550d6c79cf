"""The 8-bit KV cache (--kv-cache-dtype int8): the flag, the KV budget, and attention over the cache
on cadence's kernels and on torch ops, against float64 references computed from the quantised K/V.

Exactness with the 8-bit cache (prefill, chunking, decode, recompute, neighbours) is checked with
the rest in test_exact.py; the kernels' fused decode layers in test_cpu_kernels.py.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from test_cpu_kernels import needs_kernels

from cadence.cli import build_parser, main, serve_configs
from cadence.config import EngineConfig
from cadence.engine.core import EngineCore
from cadence.executor.model_runner import ModelRunner
from cadence.model import cpu_kernels as ck
from cadence.model.arch import ModelArchConfig
from cadence.model.attention import (
    AttentionMetadata,
    PagedKVCache,
    SeqSpan,
    dequantize_kv,
    paged_attention,
    quantize_kv,
)

CPU = torch.device("cpu")


# -- the flag ---------------------------------------------------------------------------------------


def test_flag_parses_on_the_command_line_and_in_python(capsys) -> None:
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert serve_configs(args)[0].cache.kv_cache_dtype == "int8"
    assert serve_configs(build_parser().parse_args(["serve"]))[0].cache.kv_cache_dtype == "auto"
    assert EngineConfig.from_options(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--kv-cache-dtype" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_vllms_fp8_spellings_are_refused_by_name(value: str, capsys) -> None:
    with pytest.raises(ValueError, match=rf"--kv-cache-dtype\).*{value} caches are not implemented.*auto, int8"):
        EngineConfig.from_options(kv_cache_dtype=value)
    assert main(["serve", "--kv-cache-dtype", value]) != 0
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "accepted values: auto, int8" in err


@pytest.mark.parametrize("value", ["int4", "INT8", "", "bfloat16"])
def test_other_values_are_refused_with_the_accepted_ones(value: str) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(--kv-cache-dtype\).*accepted values: auto, int8"):
        EngineConfig.from_options(kv_cache_dtype=value)


def test_the_runner_refuses_an_unknown_cache_dtype() -> None:
    arch = _arch(head_dim=32)
    from cadence.engine.builder import random_weights

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        ModelRunner(arch, random_weights(arch), kv_cache_dtype="fp8")


# -- the budget -------------------------------------------------------------------------------------


def _arch(head_dim: int, kv_heads: int = 3, layers: int = 30) -> ModelArchConfig:
    """SmolLM2-135M's attention shape by default (30 layers, 3 KV heads of 64)."""
    return ModelArchConfig(architecture="llama", vocab_size=300, hidden_size=96, intermediate_size=128,
                           num_layers=layers, num_heads=3, num_kv_heads=kv_heads, head_dim=head_dim,
                           rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True)


def test_bytes_per_block_count_the_values_and_scales() -> None:
    def per_block(kv: str, dtype: torch.dtype = torch.bfloat16) -> int:
        return PagedKVCache.bytes_per_block(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=dtype,
                                            kv_cache_dtype=kv)

    assert per_block("auto") == 2 * 30 * 16 * 3 * 64 * 2
    assert per_block("int8") == 2 * 30 * 16 * 3 * (64 + 4)  # int8 values and a float32 scale per token and head
    assert per_block("auto", torch.float32) == 2 * per_block("auto")
    cache = PagedKVCache.allocate(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=64,
                                  dtype=torch.bfloat16, device=CPU, kv_cache_dtype="int8")
    assert cache.kv.dtype == torch.int8 and cache.is_8bit and cache.num_blocks == 5 and cache.block_size == 4
    assert cache.kv.numel() == 5 * PagedKVCache.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=3,
                                                                head_dim=64, dtype=torch.bfloat16,
                                                                kv_cache_dtype="int8")


def test_the_same_kv_memory_holds_about_twice_the_tokens(caplog) -> None:
    """The engine sizes the cache from the runner's bytes per block: with SmolLM2's shape, 128 bytes
    a head a token become 68, 1.88x the blocks; the start-up log says the dtype and the capacity,
    and the calibrated profile's kv_bytes_per_token follows (calibrate reads the same runner)."""
    from cadence.engine.builder import random_weights

    arch = _arch(head_dim=64, layers=2)
    weights = random_weights(arch)
    blocks, logs = {}, {}
    for kv in ("auto", "int8"):
        runner = ModelRunner(arch, weights, dtype=torch.bfloat16, kv_cache_dtype=kv)
        config = EngineConfig.from_options(kv_cache_memory=64 << 20, kv_cache_dtype=kv)
        # The engine's own logger: `cadence sim`, run in process by other tests, sets its level.
        with caplog.at_level(logging.INFO, logger="cadence.engine.core"):
            caplog.clear()
            core = EngineCore(config, runner, max_model_len=512)
        blocks[kv] = core.num_blocks
        logs[kv] = " ".join(r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage())
        assert runner.kv_bytes_per_block(16) // 16 == 2 * 2 * 3 * (64 * 2 if kv == "auto" else 64 + 4)
    assert blocks["int8"] / blocks["auto"] == pytest.approx(128 / 68, rel=0.01)
    assert f"= {blocks['int8'] * 16} tokens in int8" in logs["int8"]
    assert f"= {blocks['auto'] * 16} tokens in bfloat16" in logs["auto"]


def test_metrics_say_the_cache_dtype_and_capacity() -> None:
    from cadence.metrics.prometheus import PrometheusExporter

    exporter = PrometheusExporter()
    exporter.record_kv_cache("int8", 123456)
    text = exporter.render()[0].decode()
    assert 'cadence:kv_cache_capacity_tokens{kv_cache_dtype="int8"} 123456.0' in text


# -- quantisation -------------------------------------------------------------------------------------


def test_quantize_kv_rounds_each_row_alone() -> None:
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 127.0], [3.0, -1.0, 1.5, 0.25]], dtype=torch.bfloat16)
    slots = quantize_kv(x)
    assert slots.dtype == torch.int8 and slots.shape == (3, 8)
    scales = slots[:, 4:].contiguous().view(torch.float32)[:, 0]
    assert scales.tolist() == [0.0, 1.0, pytest.approx(3.0 / 127)]
    assert slots[0, :4].tolist() == [0, 0, 0, 0]
    assert slots[1, :4].tolist() == [1, -2, 0, 127]  # 0.5 ties to even
    assert slots[2, :4].tolist() == [127, -42, 64, 11]  # round(x / (3 / 127))
    # A row's slots do not depend on the other rows (no shared scale).
    assert torch.equal(quantize_kv(x[2:]), slots[2:])
    back = dequantize_kv(slots, torch.float32)
    assert (back - x.float()).abs().max() <= scales.max() / 2 + 1e-6


@needs_kernels
def test_the_kernels_quantise_to_the_same_bits_as_torch() -> None:
    kernels = ck.cpu_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    for d in (32, 64, 128):
        x = (torch.randn(40, d, generator=gen) * torch.rand(40, 1, generator=gen) * 8).to(torch.bfloat16)
        x[3] = 0  # scale 0
        x[7, :] = torch.arange(d) - d // 2  # many ties at .5 steps
        slots = torch.randperm(64, generator=gen)[:40]
        out = torch.zeros(64, d + ck.KV8_SCALE_BYTES, dtype=torch.int8)
        kernels.quantize_kv8(x, slots, out)
        assert torch.equal(out[slots], quantize_kv(x)), d


@needs_kernels
def test_a_step_on_the_kernels_stores_the_bytes_torch_stores() -> None:
    """paged_attention writes a step's K/V (rows strided in the fused qkv output, slots scattered
    over blocks) through the kernels' `store_kv8`: the cache's bytes are torch's quantize_kv + copy."""
    kernels = ck.cpu_kernels()
    assert kernels is not None
    kvh, g, d, bs = 3, 3, 64, 16
    gen = torch.Generator().manual_seed(11)
    spans = [SeqSpan(0, 21, [7, 2]), SeqSpan(40, 1, [4, 0, 9]), SeqSpan(5, 1, [5])]
    qkv = torch.randn(23, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    caches = []
    for backend in (kernels, None):
        cache = PagedKVCache.allocate(num_layers=1, num_blocks=10, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                      dtype=torch.bfloat16, device=CPU, kv_cache_dtype="int8")
        paged_attention(q, kv_new, cache.layer(0), AttentionMetadata.build(spans, bs, CPU, kvh, backend))
        caches.append(cache.kv)
    assert caches[0].abs().sum() > 0 and torch.equal(caches[0], caches[1])


# -- attention over the 8-bit cache -----------------------------------------------------------------


def _float64_reference(q: torch.Tensor, layer: torch.Tensor, table: list[int], bs: int, n_ctx: int,
                       g: int) -> torch.Tensor:
    """One query [H, D] against positions 0 .. n_ctx-1 of the 8-bit cache layer, dequantised to
    float64 (the quantisation is the cache's; only the attention arithmetic is under test)."""
    pos = torch.arange(n_ctx)
    ctx = dequantize_kv(layer[:, :, torch.tensor(table)[pos // bs], pos % bs], torch.float64)  # [2, KVH, n, D]
    d = q.shape[-1]
    out = []
    for head in range(q.shape[0]):
        k, v = ctx[0, head // g], ctx[1, head // g]
        out.append(torch.softmax(k @ q[head].double() / d**0.5, dim=0) @ v)
    return torch.stack(out)


CASES = [(2, 2, 32, 4), (3, 3, 64, 16), (1, 8, 64, 16), (2, 1, 128, 8), (1, 5, 96, 32)]
# Both backends' bound against float64 over the dequantised K/V, bfloat16 queries and outputs: the
# output's rounding (up to 0.008 at |o| near 2), plus, on torch, K/V rounded to bfloat16 once more
# after dequantising (measured: kernels <= 0.0076, torch <= 0.0123).
BOUND = 1.6e-2


def _decode_and_prefill(kernels: ck.CpuKernels | None, kvh: int, g: int, d: int, bs: int) -> float:
    """A mixed step over a random 8-bit cache: a 34-token chunk continuing a 41-token context, a
    fresh 21-token prompt and decode rows of lengths across block and 16-key edges, on the given
    backend (None: torch ops); every query against its float64 reference. Returns the worst error."""
    gen = torch.Generator().manual_seed(kvh * 1000 + d + bs)
    lengths = [1, 5, 17, 16, 33, 300, 2, 64]
    nblocks = sum(-(-n // bs) for n in lengths) + 2 * -(-75 // bs) + 8
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=nblocks, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=torch.bfloat16, device=CPU, kv_cache_dtype="int8")
    cache.kv.copy_(quantize_kv(torch.randn(*cache.kv.shape[:-1], d, generator=gen).to(torch.bfloat16)))
    pool = random.Random(bs).sample(range(nblocks), nblocks)
    take = iter(pool)
    fresh_t = [next(take) for _ in range(-(-21 // bs))]
    cont_t = [next(take) for _ in range(-(-75 // bs))]
    dec_t = [[next(take) for _ in range(-(-n // bs))] for n in lengths]
    spans = [SeqSpan(0, 21, fresh_t), SeqSpan(41, 34, cont_t)] + [SeqSpan(n - 1, 1, t)
                                                                   for n, t in zip(lengths, dec_t, strict=True)]
    meta = AttentionMetadata.build(spans, bs, CPU, num_kv_heads=kvh, kernels=kernels)
    rows = 55 + len(lengths)
    qkv = torch.randn(rows, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    out = paged_attention(q, kv_new, cache.layer(0), meta)
    layer = cache.layer(0)
    worst = 0.0
    checks = [(i, fresh_t, i + 1) for i in range(21)] + [(21 + i, cont_t, 42 + i) for i in range(34)]
    checks += [(55 + i, t, n) for i, (n, t) in enumerate(zip(lengths, dec_t, strict=True))]
    for row, table, n_ctx in checks:
        ref = _float64_reference(q[row], layer, table, bs, n_ctx, g)
        worst = max(worst, (out[row].double() - ref).abs().max().item())
    return worst


@needs_kernels
@pytest.mark.parametrize("kvh,g,d,bs", CASES)
def test_kernels_over_the_8bit_cache_match_float64(kvh, g, d, bs):
    """Decode and prefill kernels read the int8 values and scales in place (contiguous 16-key runs and
    gathered ones, ragged lengths): within bfloat16's rounding of the output of the exact attention
    over the dequantised K/V; and a decode row's bits do not depend on the other rows."""
    kernels = ck.cpu_kernels()
    assert kernels is not None
    assert _decode_and_prefill(kernels, kvh, g, d, bs) < BOUND


@needs_kernels
def test_a_decode_row_over_the_8bit_cache_is_the_same_alone():
    kernels = ck.cpu_kernels()
    assert kernels is not None
    kvh, g, d, bs = 2, 3, 64, 16
    gen = torch.Generator().manual_seed(9)
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=40, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=torch.bfloat16, device=CPU, kv_cache_dtype="int8")
    cache.kv.copy_(quantize_kv(torch.randn(*cache.kv.shape[:-1], d, generator=gen).to(torch.bfloat16)))
    tables = [list(range(0, 10)), list(range(10, 12)), list(range(12, 40))]
    spans = [SeqSpan(n - 1, 1, t) for n, t in zip((150, 20, 430), tables, strict=True)]
    qkv = torch.randn(3, kvh * g + 2 * kvh, d, generator=gen).to(torch.bfloat16)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    together = paged_attention(q, kv_new, cache.layer(0), AttentionMetadata.build(spans, bs, CPU, kvh, kernels))
    alone = paged_attention(q[2:], kv_new[2:], cache.layer(0), AttentionMetadata.build(spans[2:], bs, CPU, kvh,
                                                                                        kernels))
    assert torch.equal(alone[0], together[2])


@pytest.mark.parametrize("kvh,g,d,bs", CASES)
def test_torch_path_over_the_8bit_cache_meets_the_kernels_bound(kvh, g, d, bs):
    """Without the kernels (CADENCE_CPU_KERNELS=0 or no AVX512-BF16), attention dequantises the
    gathered blocks: the same float64 bound as the kernels, prefill chunks and decodes alike."""
    assert _decode_and_prefill(None, kvh, g, d, bs) < BOUND


def test_torch_path_first_chunk_reads_its_own_kv_as_stored():
    """A prompt's first chunk attends to its K/V as the cache holds them (quantised), so a position
    computes the same whether its prompt came in one chunk or two."""
    kvh, g, d, bs = 2, 2, 32, 4
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache.allocate(num_layers=1, num_blocks=8, block_size=bs, num_kv_heads=kvh, head_dim=d,
                                  dtype=torch.float32, device=CPU, kv_cache_dtype="int8")
    qkv = torch.randn(12, kvh * g + 2 * kvh, d, generator=gen)
    q, kv_new = qkv[:, : kvh * g], qkv[:, kvh * g :].unflatten(1, (2, kvh))
    table = [3, 1, 6]
    whole = paged_attention(q, kv_new, cache.layer(0), AttentionMetadata.build([SeqSpan(0, 12, table)], bs, CPU, kvh))
    first = paged_attention(q[:5], kv_new[:5], cache.layer(0), AttentionMetadata.build([SeqSpan(0, 5, table)], bs,
                                                                                         CPU, kvh))
    rest = paged_attention(q[5:], kv_new[5:], cache.layer(0), AttentionMetadata.build([SeqSpan(5, 7, table)], bs,
                                                                                        CPU, kvh))
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=1e-6, rtol=1e-6)


# -- the simulator ----------------------------------------------------------------------------------


def test_simulating_the_8bit_cache_needs_a_profile_calibrated_with_it() -> None:
    """A profile's kv_bytes_per_token and attention costs are those of the cache it was calibrated
    with (calibrate records kv_cache_dtype): int8 on a profile of another cache is refused."""
    from cadence.executor.cost_model import StepCostModel
    from cadence.sim.simulator import Simulator

    config = EngineConfig.from_options(kv_cache_memory=1 << 30, kv_cache_dtype="int8")
    for meta in ({"kv_bytes_per_token": 23040}, {"kv_bytes_per_token": 23040, "kv_cache_dtype": "bfloat16"}):
        with pytest.raises(ValueError, match=r"--kv-cache-dtype\): int8, but the profile was calibrated with"):
            Simulator(config, StepCostModel("tokens", {"const": 0.1}, meta))
    per_token = 2 * 30 * 3 * 68  # the 8-bit cache's bytes a token for SmolLM2's shape
    sim = Simulator(config, StepCostModel("tokens", {"const": 0.1}, {"kv_bytes_per_token": per_token,
                                                                       "kv_cache_dtype": "int8"}))
    assert sim.replicas[0].core.num_blocks == (1 << 30) // (per_token * 16)


# -- served -------------------------------------------------------------------------------------------


def test_served_with_the_8bit_cache_metrics_say_its_dtype_and_capacity() -> None:
    """`cadence serve --kv-cache-dtype int8` end to end on the tiny model (torch path): a completion
    runs, and /metrics reports the capacity under the int8 label."""
    from fastapi.testclient import TestClient

    from cadence.config import ServerConfig
    from cadence.engine.async_engine import AsyncEngine
    from cadence.engine.builder import build_engine
    from cadence.server.app import create_app

    config = EngineConfig.from_options(kv_cache_memory=4 << 20, kv_cache_dtype="int8", max_model_len=256,
                                       device="cpu", dtype="float32")
    engine = AsyncEngine(build_engine(config, tiny=True))
    try:
        core = engine.engine.core
        assert core.kv_cache_dtype == "int8" and core.executor.kv_cache.is_8bit
        with TestClient(create_app(engine, ServerConfig())) as client:
            r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
            text = client.get("/metrics").text
    finally:
        engine.shutdown(timeout=10)
    capacity = core.num_blocks * 16
    assert f'cadence:kv_cache_capacity_tokens{{kv_cache_dtype="int8"}} {capacity:.1f}' in text
    # The tiny model: 2 layers, 2 KV heads of 16: 20 bytes a head a token, not float32's 64.
    assert core.num_blocks == (4 << 20) // (2 * 2 * 2 * 20 * 16)


def test_llm_takes_kv_cache_dtype() -> None:
    from cadence import LLM, SamplingParams

    llm = LLM(tiny=True, kv_cache_dtype="int8", num_kv_blocks=64, max_model_len=256, device="cpu", dtype="float32")
    assert llm.engine.core.executor.kv_cache.is_8bit
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        LLM(tiny=True, kv_cache_dtype="fp8_e5m2")
