"""int8 activations in the model: which layers take the integer path, the refusals, and the default
model through the engine with and without the 8-bit KV cache (the quality figures are pinned in
tests/model/test_quality_pin.py; docs/performance.md has the long text's)."""

from __future__ import annotations

import random

import pytest
import torch
from benchmark_scripts import load_benchmark
from test_cpu_kernels import kernel_model, needs_kernels
from test_int8_kernels import int8_model, needs_vnni

from cadence.executor.model_runner import ModelRunner
from cadence.model import llama

pytestmark = [needs_kernels, needs_vnni]


def test_quantized_layers_and_the_output_layer_take_the_integer_path():
    arch, weights, q4_1, q8_0, q4_0 = int8_model(seed=3)
    runner = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0,
                         activation_dtype="int8")
    model = runner.model
    for layer in model.layers:
        assert (layer.qkv.i8_format, layer.o.i8_format, layer.gate_up.i8_format, layer.down.i8_format) == (
            "Q4_1", "Q4_0", "Q4_1", "Q8_0")
        assert layer.qkv.q4_1 is None and layer.qkv.packed is None and layer.qkv.weight is None  # one copy
    assert model.lm_head.i8_format == "Q8_0" and model.lm_head.path.endswith("int8 activations in two terms")
    # By default gate-up (and the output layer) in two int8 terms: kind 4; the others in one.
    assert [lin.i8_terms for lin in (model.layers[0].qkv, model.layers[0].o, model.layers[0].gate_up,
                                     model.layers[0].down, model.lm_head)] == [1, 1, 2, 1, 2]
    assert model.fused_decode is not None and model.fused_decode.kinds.tolist() == [[2, 2, 4, 3]] * arch.num_layers
    # The same checkpoint with bfloat16 activations (the default): none of it.
    plain = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0).model
    assert plain.layers[0].down.i8 is None and plain.lm_head.i8 is None and plain.layers[0].qkv.q4_1 is not None
    assert plain.layers[0].o.i8 is None and plain.layers[0].o.packed is not None  # Q4_0: dequantised, as before
    # Logits of a prefill: close to the bfloat16 path's (the same weights, noisier activations).
    runner.initialize_kv_cache(16, 16)
    tokens = [random.Random(0).randrange(arch.vocab_size) for _ in range(40)]
    window_logits = load_benchmark("quality").window_logits
    got = window_logits(runner, tokens)
    other = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, q8_0=q8_0, q4_0=q4_0)
    other.initialize_kv_cache(16, 16)
    want = window_logits(other, tokens)
    assert not torch.equal(got, want)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_layer_without_quantized_blocks_keeps_the_bfloat16_kernel():
    arch, weights, q4_1 = kernel_model(True, False, seed=4)
    q4_1 = {k: v for k, v in q4_1.items() if "down_proj" not in k}
    model = ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, activation_dtype="int8").model
    assert model.layers[0].qkv.i8_format == "Q4_1" and model.layers[0].down.i8 is None
    assert model.layers[0].down.path == "cadence's kernel on bfloat16 weights"
    assert model.lm_head.i8 is None  # a bfloat16 embedding: the output layer too
    assert model.fused_decode is not None and model.fused_decode.kinds[0].tolist() == [2, 2, 4, 0]


def test_unknown_two_term_kinds_are_refused():
    arch, weights, q4_1 = kernel_model(True, False, seed=6)
    with pytest.raises(ValueError, match=r"int8_two_terms: \['mlp'\]"):
        ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, activation_dtype="int8",
                    int8_two_terms=frozenset({"gate_up", "mlp"}))


def test_int8_without_vnni_is_refused(monkeypatch):
    monkeypatch.setattr(llama, "has_vnni", lambda: False)
    arch, weights, q4_1 = kernel_model(True, False, seed=5)
    with pytest.raises(ValueError, match="^activation_dtype: int8 needs a CPU with AVX512-VNNI"):
        ModelRunner(arch, weights, dtype=torch.bfloat16, q4_1=q4_1, activation_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_default_model_on_int8_through_the_engine_alone_or_batched(kv_cache_dtype):
    """`LLM(activation_dtype="int8")`, on the bfloat16 KV cache and on the 8-bit one: the default model's
    layers and output layer on the int8 kernels, and each request's greedy tokens the same alone as in a
    batch whose prompts are cut into chunks (prefill chunks, then the all-decode step, taking both)."""
    from cadence import LLM
    from cadence.request import SamplingParams

    llm = LLM(activation_dtype="int8", kv_cache_dtype=kv_cache_dtype, num_kv_blocks=128, max_num_batched_tokens=24)
    runner = llm.engine.core.executor
    model = runner.model
    assert {lin.i8_format for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {
        "Q4_1"}
    assert model.lm_head.i8_format == "Q8_0" and model.fused_decode is not None
    assert runner.kv_cache is not None
    assert (runner.kv_cache.kv.dtype == torch.int8) == (kv_cache_dtype == "int8")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "1, 2, 3,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 12 for t in together)
