"""A draft model path that exists but is no model (a device such as /dev/null) is named for what it is."""

from __future__ import annotations

import pytest

from cadence import LLM


def test_a_character_device_as_the_draft_model_says_what_it_is() -> None:
    spec = {"method": "draft_model", "model": "/dev/null", "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as caught:
        LLM(tiny=True, num_kv_blocks=16, speculative_config=spec)
    message = str(caught.value)
    assert message.startswith("speculative_config.model:"), message
    assert "/dev/null: not a model: a character device, neither a regular file nor a directory" in message
    assert "no such file" not in message
