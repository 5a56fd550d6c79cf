"""Tokenizer from a GGUF file or a Hugging Face directory, with its chat template.

Message content is always plain text: typing `<|im_start|>` in a chat message yields the tokens of
those characters, never the control token; only a chat template's own markers become control
tokens (see chat_template.py for how contents are told apart from markers). A raw prompt (a
completion, an offline prompt) may instead be read as Hugging Face and vLLM read it, special-token
text as the token it names: `encode(text, split_special_tokens=False)`. The streaming side
(`IncrementalDetokenizer`, `StopChecker`) lives in detokenizer.py and is re-exported here.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from cadence.model.chat_template import RenderedChat, render_chat
from cadence.model.detokenizer import IncrementalDetokenizer, StopChecker
from cadence.model.gguf_file import LoadError, field_value, open_gguf
from cadence.model.loader import default_model_path, missing_model_message
from cadence.model.template_limits import ChatTemplateLimitError, RenderLimits
from cadence.model.template_process import template_processes

__all__ = ["IncrementalDetokenizer", "StopChecker", "Tokenizer"]

log = logging.getLogger("cadence")

# Longer texts go through `encode_batch`, which releases the GIL while it works (`encode` holds it
# throughout: 0.4 s for a megabyte, during which no other Python thread, the event loop included, runs).
_RELEASE_GIL_CHARS = 4096
# The conversations the model's template is rendered on at load: a template that cannot render
# these within its limits cannot serve any chat.
_PROBES: tuple[tuple[list[dict[str, str]], bool], ...] = (
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], False),
    ([{"role": "user", "content": "Hi"}], True),
)

# Split rules of the byte-level BPE families llama.cpp names in `tokenizer.ggml.pre`, as their
# tokenizer.json files define them. None: ByteLevel's built-in GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreSpec:
    split: str | None = None
    individual_digits: bool = False  # SmolLM, StarCoder: every digit its own pre-token
    ignore_merges: bool = False  # Llama 3: a whole pre-token found in the vocabulary is one token
    nfc: bool = False  # Qwen2 normalises to NFC first


_GPT2 = _PreSpec()
_DIGITS = _PreSpec(individual_digits=True)
_LLAMA3 = _PreSpec(split=_LLAMA3_SPLIT, ignore_merges=True)
_QWEN2 = _PreSpec(split=_QWEN2_SPLIT, nfc=True)
_PRE_TOKENIZERS: dict[str, _PreSpec] = {
    "default": _GPT2, "gpt2": _GPT2,
    "smollm": _DIGITS, "starcoder": _DIGITS, "refact": _DIGITS,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3, "dbrx": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}  # fmt: skip
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types


def _pre_tokenizer(spec: _PreSpec) -> Any:
    steps: list[Any] = []
    if spec.individual_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if spec.split is not None:
        steps.append(pre_tokenizers.Split(Regex(spec.split), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.split is None))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _build_byte_level(path: Path, tokens: list[str], merges: list[str], types: list[int], spec: _PreSpec) -> HFTokenizer:
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise LoadError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        pairs.append((a, b))
    try:
        model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, ignore_merges=spec.ignore_merges)
    except Exception as e:  # tokenizers raises plain Exception for merges outside the vocabulary
        raise LoadError(f"{path}: inconsistent vocabulary and merges ({e})") from None
    tok = HFTokenizer(model)
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(spec)
    tok.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _TOKEN_USER_DEFINED])
    return tok


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def _encode_ids(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _RELEASE_GIL_CHARS:
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"{path}: cannot read JSON ({e})") from None
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """Encode, decode and apply the chat template of one model. Thread-safe for reading.

    The model's chat template is rendered at construction on two probe conversations, under
    `template_limits`: one that goes over them raises LoadError naming the template, since it
    could serve no chat."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        name: str,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        template_limits: RenderLimits | None = None,
    ) -> None:
        self._tok = tok
        # A twin that never parses special-token text: message contents, and prompts read literally.
        self._plain = HFTokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.template_limits = (template_limits or RenderLimits()).validate()
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(specials.values())
        self._special_by_text = specials
        alternatives = sorted(specials, key=len, reverse=True)  # longest first, like the tokenizer's matcher
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
        eos = {i for i in (eos_token_id, *extra_eos_ids) if i is not None and 0 <= i < self.vocab_size}
        turn_end = self._turn_end_id(self._probe_template())
        self.eos_token_ids: frozenset[int] = frozenset(eos | ({turn_end} if turn_end is not None else set()))

    # ----- construction -----

    @classmethod
    def from_model_path(cls, path: str | Path | None, template_limits: RenderLimits | None = None,
                        chat_template: str | None = None) -> Tokenizer:
        """From a GGUF file, or a directory with tokenizer.json (or exactly one .gguf); None: the default
        model. `chat_template`: used instead of the model's own (checked on the probes the same way)."""
        p = default_model_path() if path is None else Path(path)
        if p.is_dir():
            if (p / "tokenizer.json").is_file():
                return cls.from_hf_dir(p, template_limits, chat_template)
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0], template_limits, chat_template)
            raise LoadError(f"{p}: no tokenizer.json (nor exactly one .gguf file) in this directory")
        if not p.exists():
            raise LoadError(missing_model_message(p))
        return cls.from_gguf(p, template_limits, chat_template)

    @classmethod
    def from_gguf(cls, path: str | Path, template_limits: RenderLimits | None = None,
                  chat_template: str | None = None) -> Tokenizer:
        path = Path(path)
        reader = open_gguf(path)

        def get(key: str) -> Any:
            return field_value(reader, f"tokenizer.{key}")

        kind, pre = get("ggml.model"), get("ggml.pre") or "default"
        if kind != "gpt2":
            raise LoadError(f"{path}: tokenizer model {kind!r} is not supported from GGUF (byte-level BPE 'gpt2' is); "
                            "use the model's Hugging Face directory instead")
        if pre not in _PRE_TOKENIZERS:
            raise LoadError(f"{path}: pre-tokenizer {pre!r} is not supported (supported: {sorted(_PRE_TOKENIZERS)})")
        tokens, merges = get("ggml.tokens"), get("ggml.merges")
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
            raise LoadError(f"{path}: tokenizer.ggml.tokens is missing or not a list of strings")
        if not (isinstance(merges, list) and all(isinstance(m, str) for m in merges)):
            raise LoadError(f"{path}: tokenizer.ggml.merges is missing or not a list of strings")
        types = get("ggml.token_type") or [1] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens):
            raise LoadError(f"{path}: tokenizer.ggml.token_type does not match the {len(tokens)} tokens")
        tok = _build_byte_level(path, tokens, merges, types, _PRE_TOKENIZERS[pre])
        ids = {k: get(f"ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
        for k, v in ids.items():
            if v is not None and not (isinstance(v, int) and 0 <= v < len(tokens)):
                raise LoadError(f"{path}: tokenizer.ggml.{k}_token_id {v} is outside the vocabulary")
        template = chat_template if chat_template is not None else get("chat_template")
        if get("ggml.add_bos_token") and ids["bos"] is not None:
            bos = tokens[ids["bos"]]
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, ids["bos"])])
        return cls(tok, name=path.stem, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                   pad_token_id=ids["padding"], chat_template=template if isinstance(template, str) else None,
                   template_limits=template_limits)  # fmt: skip

    @classmethod
    def from_hf_dir(cls, path: str | Path, template_limits: RenderLimits | None = None,
                    chat_template: str | None = None) -> Tokenizer:
        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            raise LoadError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises plain Exception on bad files
            raise LoadError(f"{tj}: cannot read tokenizer ({str(e).splitlines()[0] if str(e) else e})") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if chat_template is not None:
            template = chat_template
        extra = _ids(_read_json(folder / "generation_config.json").get("eos_token_id"))
        extra |= _ids(_read_json(folder / "config.json").get("eos_token_id"))

        def tid(key: str) -> int | None:
            text = _token_text(cfg.get(key))
            return tok.token_to_id(text) if text is not None else None

        return cls(tok, name=folder.name, bos_token_id=tid("bos_token"), eos_token_id=tid("eos_token"),
                   pad_token_id=tid("pad_token"), chat_template=template if isinstance(template, str) else None,
                   extra_eos_ids=extra, template_limits=template_limits)  # fmt: skip

    # ----- the basics -----

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def save_json(self, path: str | Path) -> None:
        """Write the tokenizer as a Hugging Face tokenizer.json (its vocabulary, merges and specials)."""
        self._tok.save(str(path))

    def vocabulary(self) -> dict[str, int]:
        """Every token's text and id, added tokens included (to tell whether two models share one)."""
        return self._tok.get_vocab(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its longest spelling: a byte-level token's
        string has a character per byte). A text of n characters is at least n / this many tokens,
        which refuses a text far over a context without tokenizing it."""
        return max(1, max(len(t) for t in self._tok.get_vocab(with_added_tokens=True)))

    def check_fits(self, text: str, max_tokens: int, param: str) -> None:
        """ValueError naming `param` when `text` cannot be `max_tokens` tokens or fewer."""
        least = -(-len(text) // self.max_token_chars)
        if least > max_tokens:
            raise ValueError(f"{param}: {len(text)} characters are at least {least} tokens, more than this "
                             f"model's context of {max_tokens} tokens (max_model_len)")

    def encode(self, text: str, add_special_tokens: bool = False, *, split_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model adds (e.g. BOS).

        `split_special_tokens` (transformers' name and meaning): True, the default here, reads
        special-token text such as `<|im_start|>` as ordinary characters; False reads it as the
        token it names, as a pre-templated prompt needs."""
        if not isinstance(text, str):
            raise ValueError(f"text: must be a string, not {type(text).__name__}")
        return _encode_ids(self._plain if split_special_tokens else self._tok, text, add_special_tokens)

    @functools.cached_property
    def _special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after a text (a Llama BOS: [bos], [])."""
        probe = "a"
        bare = _encode_ids(self._tok, probe, add_special_tokens=False)
        full = _encode_ids(self._tok, probe, add_special_tokens=True)
        at = next((i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare), None)
        if at is None:  # a post-processor that rewrites the text's own ids: add nothing rather than guess
            return [], []
        return full[:at], full[at + len(bare) :]

    def add_special_tokens(self, ids: Sequence[int]) -> list[int]:
        """`ids` with what `encode(..., add_special_tokens=True)` adds around a text (e.g. a BOS)."""
        before, after = self._special_affixes
        return [*before, *ids, *after]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary decode to nothing."""
        ids = list(ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError("token ids: must be non-negative integers")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """How one token reads, for logprobs: its text, or its raw spelling when it is part of a character."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            return self._tok.id_to_token(token_id) or ""
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # ----- chat -----

    def render_chat(self, messages: Any, add_generation_prompt: bool = True, chat_template: str | None = None,
                    tools: list[dict[str, Any]] | None = None) -> RenderedChat:
        """The chat as text, with where each message's content lies in it. `tools` reaches the template
        as transformers' `apply_chat_template(tools=...)` passes it. Raises ChatTemplateLimitError
        (a ValueError) when the template goes over `template_limits`."""
        variables = self._template_variables()
        if tools is not None:
            variables["tools"] = tools
        if chat_template is not None:  # a caller's template: in a worker process that can be killed
            return template_processes().render(chat_template, messages, add_generation_prompt,
                                               variables, self.template_limits)
        if self.chat_template is None:
            raise ValueError("chat_template: this model has no chat template; pass one")
        return render_chat(self.chat_template, messages, add_generation_prompt, variables, self.template_limits)

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, chat_template: str | None = None,
        max_tokens: int | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the rendered chat: template markers as control tokens, message contents as plain
        text. With `max_tokens`, a rendering that cannot fit in as many tokens is refused untokenized."""
        chat = self.render_chat(messages, add_generation_prompt, chat_template, tools)
        if max_tokens is not None:
            self.check_fits(chat.text, max_tokens, "chat_template" if chat_template is not None else "messages")
        if self._special_re is not None:
            self._refuse_markers_outside_content(messages)
            self._refuse_markers("tools", tools)
            if any(self._special_re.search(c) for c in chat.unlocated):
                raise ValueError("messages: a content holding control-token text was rewritten by the chat template")
        return self._encode_chat(chat)

    def _refuse_markers_outside_content(self, messages: Any) -> None:
        """Roles, names, tool calls are written by the template as they are: control-token text there
        would be a control token, so it is refused (contents are safe, they are tokenized as plain text)."""
        for i, m in enumerate(messages):
            for key, value in m.items():
                if key != "content":
                    self._refuse_markers(f"messages[{i}].{key}", value)

    def _refuse_markers(self, where: str, value: Any) -> None:
        """ValueError naming `where` when any string inside `value` (keys too) holds control-token text."""
        assert self._special_re is not None
        if isinstance(value, str):
            if self._special_re.search(value):
                raise ValueError(f"{where}: must not contain control-token text")
        elif isinstance(value, Mapping):
            for k, v in value.items():
                self._refuse_markers(where, k)
                self._refuse_markers(where, v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._refuse_markers(where, v)

    def _encode_chat(self, chat: RenderedChat) -> list[int]:
        text, ids, pos = chat.text, [], 0
        if self._special_re is None:
            return self.encode(text)
        starts = [a for a, _ in chat.content_spans]  # in order and disjoint

        def in_content(m: re.Match[str]) -> bool:
            k = bisect.bisect_left(starts, m.end()) - 1  # the last span starting before the match ends
            return k >= 0 and chat.content_spans[k][1] > m.start()

        if not any(in_content(m) for m in self._special_re.finditer(text)):
            # The usual case, no marker text inside any content: one call, exactly as the model's
            # own tokenizer would do it (normalizers that prefix only the first piece included).
            return _encode_ids(self._tok, text, add_special_tokens=False)
        # Control tokens count only where the template wrote them: between content spans.
        bounds = [0, *(x for span in chat.content_spans for x in span), len(text)]
        for start, end in zip(bounds[::2], bounds[1::2], strict=True):
            for m in self._special_re.finditer(text, start, end):
                ids += self.encode(text[pos : m.start()])
                ids.append(self._special_by_text[m.group()])
                pos = m.end()
        return ids + self.encode(text[pos:])

    def _template_variables(self) -> dict[str, Any]:
        def text(i: int | None) -> str | None:
            return self._tok.id_to_token(i) if i is not None else None

        return {"bos_token": text(self.bos_token_id), "eos_token": text(self.eos_token_id),
                "pad_token": text(self.pad_token_id)}  # fmt: skip

    def _probe_template(self) -> RenderedChat | None:
        """Render the model's template on the probe conversations: the first one's rendering, or None
        where there is no template or it fails on it (logged: chats will fail the same way)."""
        if self.chat_template is None:
            return None
        rendered: list[RenderedChat | None] = []
        for messages, add_generation_prompt in _PROBES:
            try:
                rendered.append(self.render_chat(messages, add_generation_prompt))
            except ChatTemplateLimitError as e:
                raise LoadError(f"{self.name}: the model's chat template {e.what} on a {len(messages)}-message "
                                f"probe conversation{e.hint()}") from None
            except ValueError as e:
                log.warning("%s: the model's chat template fails on a probe conversation: %s", self.name, e)
                rendered.append(None)
        return rendered[0]

    def _turn_end_id(self, probe: RenderedChat | None) -> int | None:
        """The control token the template writes right after an assistant turn (e.g. <|im_end|>)."""
        if probe is None or self._special_re is None or not probe.content_spans:
            return None
        m = self._special_re.match(probe.text, probe.content_spans[-1][1])
        return self._special_by_text[m.group()] if m else None
