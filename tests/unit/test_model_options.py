"""Model-loading options a vLLM user reaches for: --chat-template, and a hub id given as the model."""

from __future__ import annotations

import pytest

from cadence.config import EngineConfig
from cadence.engine.builder import build_engine
from cadence.model.gguf_file import LoadError
from cadence.model.loader import load_checkpoint
from cadence.model.tokenizer import Tokenizer

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
CHAT = [{"role": "user", "content": "hi"}]


def _engine(chat_template: str):
    return build_engine(EngineConfig.from_options(chat_template=chat_template, dtype="float32", num_kv_blocks=64),
                        tiny=True)


def test_chat_template_given_as_text_or_file_replaces_the_models(tmp_path) -> None:
    default = build_engine(EngineConfig.from_options(dtype="float32", num_kv_blocks=64), tiny=True)
    assert default.tokenizer.render_chat(CHAT).text != "<user>hi\n<a>"
    assert _engine(TEMPLATE).tokenizer.render_chat(CHAT).text == "<user>hi\n<a>"
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert _engine(str(f)).tokenizer.render_chat(CHAT).text == "<user>hi\n<a>"
    with pytest.raises(ValueError, match="chat_template: .*missing.jinja: no such file"):
        _engine(str(tmp_path / "missing.jinja"))


def test_a_chat_template_over_the_limits_fails_start_up() -> None:
    looping = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    with pytest.raises(LoadError, match="chat template"):
        build_engine(EngineConfig.from_options(chat_template=looping, dtype="float32", num_kv_blocks=64,
                                               chat_template_timeout=0.5), tiny=True)


@pytest.mark.parametrize("load", [Tokenizer.from_model_path, load_checkpoint])
def test_a_hub_id_says_that_nothing_is_fetched(load) -> None:
    with pytest.raises(LoadError) as e:
        load("HuggingFaceTB/SmolLM2-135M-Instruct")
    text = str(e.value)
    assert "no such file or directory" in text and "hub id" in text and "downloads nothing" in text
    with pytest.raises(LoadError) as e:
        load("no/such/model.gguf")
    assert "hub id" not in str(e.value)
