"""A draft model: proposes each speculating request's next tokens, greedily, for the next step.

The model runner owns it and calls it after the target model's step (vLLM V1's shape): the
scheduler names in `SchedulerOutput.draft_requests` who wants drafts, with the context tokens not
yet sent; the drafter appends what the target sampled or verified for the request in this step
and runs the draft model greedily (argmax) for up to k tokens after that context. A greedy
proposal puts all its mass on one token, so the target's verification rule (`Sampler.verify`)
stays exact for greedy and sampling requests alike.

The draft's K/V live in the drafter's own paged cache (its own layers, its own blocks), per
request. In an engine the cache has as many blocks as the served model's, its bytes counted in
the same KV cache memory (`ModelRunner.kv_bytes_per_block`); when a step's requests need more
(the drafter shares no prefix blocks), the K/V of the requests not drafted for that step are
dropped first (they are fed again as one chunk when next drafted for), and a request that still
does not fit gets no drafts that step. Outside an engine the cache starts small and doubles
when full. A position's K/V are kept only while the token fed there is the context's token: the
drafts fed while proposing are rolled back when the target rejects them (the next context
differs there), and the tokens the draft has not seen (the prompt, accepted tokens, the target's
own token) are fed in one chunk before proposing. Requests are batched: one forward pass catches
every request up and gives its first draft, then one decode pass per further draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cadence.boundary import DraftRequest, ModelOutput, SchedulerOutput
from cadence.model.arch import ModelArchConfig
from cadence.model.attention import AttentionMetadata, PagedKVCache, SeqSpan, to_device
from cadence.model.llama import LlamaModel

INITIAL_BLOCKS = 64  # the draft cache's first size; it doubles when full


@dataclass
class _DraftState:
    """One request's context as the drafter knows it, and what its draft cache holds."""

    context: list[int] = field(default_factory=list)  # as sent by the scheduler, then this step's tokens
    fed: list[int] = field(default_factory=list)  # the token at each position with K/V in the cache
    checked: int = 0  # leading positions of `fed` known to hold the context's tokens
    blocks: list[int] = field(default_factory=list)
    last_drafted: int = 0  # the drafter's call count when it last proposed for the request


class Drafter:
    """The draft model, its paged K/V cache and each request's state in it."""

    def __init__(self, arch: ModelArchConfig, weights: dict[str, torch.Tensor], *, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 q4_1: dict[str, torch.Tensor] | None = None) -> None:
        self.arch = arch
        self.device = torch.device(device)
        self.model = LlamaModel(arch, weights, dtype=dtype, device=self.device, q4_1=q4_1)
        self.block_size = block_size
        self.cache = PagedKVCache.allocate(num_layers=arch.num_layers, num_blocks=INITIAL_BLOCKS, block_size=block_size,
                                           num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, dtype=dtype,
                                           device=self.device)
        self._free = list(range(INITIAL_BLOCKS - 1, -1, -1))
        self.states: dict[str, _DraftState] = {}
        self.fixed_size = False  # a budgeted cache (`initialize_cache`): never grows
        self._calls = 0

    def bytes_per_block(self) -> int:
        """The draft cache's bytes per block."""
        return PagedKVCache.bytes_per_block(num_layers=self.arch.num_layers, block_size=self.block_size,
                                            num_kv_heads=self.arch.num_kv_heads, head_dim=self.arch.head_dim,
                                            dtype=self.model.dtype)

    def initialize_cache(self, num_blocks: int) -> None:
        """A cache of exactly `num_blocks` blocks, which never grows (all state dropped)."""
        a = self.arch
        self.cache = PagedKVCache.allocate(num_layers=a.num_layers, num_blocks=num_blocks, block_size=self.block_size,
                                           num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, dtype=self.model.dtype,
                                           device=self.device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self.states.clear()
        self.fixed_size = True

    @property
    def max_positions(self) -> int:
        return int(self.model.cos.shape[0])

    # -- the model runner's entry point -----------------------------------------------------------

    def attach(self, out: SchedulerOutput, result: ModelOutput) -> ModelOutput:
        """`result` with the drafts for the step's `draft_requests`; ended requests' state freed."""
        self.forget(out.finished_ids)
        self.forget(out.preempted_ids)
        if not out.draft_requests:
            return result
        contexts: dict[str, tuple[list[int], int]] = {}
        for rid, want in out.draft_requests.items():
            state = self._sync(rid, want)
            step = result.verified_token_ids.get(rid)
            if step is None and rid in result.sampled_token_ids:
                step = (result.sampled_token_ids[rid],)
            if step:
                # Appended in place (no copy of the context); the next sync cuts them off again
                # and takes the scheduler's tokens, which are these unless the request ended.
                state.context.extend(step)
                contexts[rid] = (state.context, want.k)
        return replace(result, draft_token_ids=self.propose(contexts))

    def forget(self, request_ids: tuple[str, ...] | list[str]) -> None:
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                self._free.extend(state.blocks)

    # -- proposing ---------------------------------------------------------------------------------

    def propose(self, contexts: dict[str, tuple[list[int], int]]) -> dict[str, tuple[int, ...]]:
        """Up to k greedy draft tokens after each request's context (`{request_id: (context, k)}`);
        a request without state starts with an empty cache."""
        jobs: dict[str, int] = {}
        spans: list[tuple[str, int, list[int]]] = []  # (request, first position fed, tokens fed)
        self._calls += 1
        for rid, (context, k) in contexts.items():
            k = min(k, self.max_positions - len(context) + 1)  # the last draft is predicted, not fed
            if k < 1 or not context:
                continue
            state = self.states.setdefault(rid, _DraftState())
            state.last_drafted = self._calls
            start = self._rollback(state, context)
            if not self._reserve(state, len(context) + k - 1, contexts):
                continue  # no room in the budgeted cache this step: no drafts for it
            spans.append((rid, start, context[start:]))
            state.fed.extend(context[start:])
            state.checked = len(context)
            jobs[rid] = k
        if not spans:
            return {}
        spans.sort(key=lambda s: len(s[2]) == 1)  # chunks before single tokens, as attention wants
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in spans}
        while spans:
            for (rid, _, _), token in zip(spans, self._forward(spans), strict=True):
                drafts[rid].append(token)
            spans = [(rid, len(self.states[rid].fed), [d[-1]]) for rid, d in drafts.items() if len(d) < jobs[rid]]
            for rid, _, tokens in spans:
                self.states[rid].fed.extend(tokens)
        return {rid: tuple(d) for rid, d in drafts.items()}

    def _sync(self, rid: str, want: DraftRequest) -> _DraftState:
        """Take in the context tokens the scheduler sent (from `offset`: what the drafter appended
        itself after that, the tokens of the step before, is replaced by the scheduler's)."""
        state = self.states.get(rid)
        if want.offset == 0:
            if state is None:
                state = self.states[rid] = _DraftState()
            state.context = list(want.new_tokens)
            state.checked = 0  # a context sent afresh: check every position the cache holds
            return state
        if state is None or len(state.context) < want.offset:
            have = "no context" if state is None else f"{len(state.context)} context tokens"
            raise RuntimeError(f"draft model: request {rid} sent tokens from index {want.offset}, but the drafter has {have}")
        del state.context[want.offset :]
        state.context.extend(want.new_tokens)
        state.checked = min(state.checked, want.offset)  # the tokens past it are checked again
        return state

    @staticmethod
    def _rollback(state: _DraftState, context: list[int]) -> int:
        """Drop the cached positions whose token is not the context's; returns the first position
        to feed (at least the last one: its logits give the first draft)."""
        fed = state.fed
        keep = min(state.checked, len(fed), len(context))
        limit = min(len(fed), len(context))
        while keep < limit and fed[keep] == context[keep]:
            keep += 1
        keep = min(keep, len(context) - 1)
        del fed[keep:]
        return keep

    def _reserve(self, state: _DraftState, num_positions: int, drafting: dict[str, tuple[list[int], int]]) -> bool:
        """Blocks for `num_positions` of the request's positions; False when a budgeted cache cannot
        hold them even with the K/V of every request not in `drafting` dropped."""
        need = -(-num_positions // self.block_size) - len(state.blocks)
        while len(self._free) < need:
            if not self.fixed_size:
                self._grow()
            elif not self._evict(drafting):
                return False
        for _ in range(max(0, need)):
            state.blocks.append(self._free.pop())
        return True

    def _evict(self, drafting: dict[str, tuple[list[int], int]]) -> bool:
        """Drop the K/V of the request drafted for least recently among those not drafted for in
        this call (its context is kept: its tokens are fed again when it is next drafted for);
        False when there is none."""
        idle = [(s.last_drafted, rid) for rid, s in self.states.items() if s.blocks and rid not in drafting]
        if not idle:
            return False
        state = self.states[min(idle)[1]]
        self._free.extend(state.blocks)
        state.blocks, state.fed, state.checked = [], [], 0
        return True

    def _grow(self) -> None:
        """Double the draft cache (its blocks keep their ids)."""
        old = self.cache.kv
        n = old.shape[3]
        kv = old.new_zeros((*old.shape[:3], 2 * n, *old.shape[4:]))
        kv[:, :, :, :n] = old
        self.cache = PagedKVCache(kv)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def _forward(self, spans: list[tuple[str, int, list[int]]]) -> list[int]:
        """Feed each span's tokens at its positions; the argmax after each span's last token."""
        ids: list[int] = []
        last: list[int] = []
        seqs = []
        for rid, start, tokens in spans:
            ids.extend(tokens)
            last.append(len(ids) - 1)
            seqs.append(SeqSpan(start, len(tokens), self.states[rid].blocks))
        model = self.model
        meta = AttentionMetadata.build(seqs, self.block_size, self.device, self.arch.num_kv_heads, model.decode_kernels)
        with torch.inference_mode():
            logits = model(to_device(torch.tensor(ids, dtype=torch.long), self.device), meta, self.cache,
                           to_device(torch.tensor(last, dtype=torch.long), self.device))
            return logits.argmax(dim=-1).tolist()


def load_drafter(path: str, target_vocab_size: int, target_vocab: dict[str, int] | None, *, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> Drafter:
    """The draft model of `speculative_config.model`, refused (ValueError naming the field) when
    it cannot be loaded or its vocabulary is not the target's: a draft token must mean the same
    text to both models, or its proposals are noise and its ids may fall outside the target's."""
    from cadence.model.loader import LoadError, load_checkpoint, missing_model_message
    from cadence.model.tokenizer import Tokenizer

    where = Path(path).expanduser()
    if not where.exists():
        raise ValueError(f"speculative_config.model: {missing_model_message(where)}")
    try:
        ckpt = load_checkpoint(where, dtype)
    except (LoadError, OSError) as e:
        raise ValueError(f"speculative_config.model: cannot load the draft model: {e}") from None
    if ckpt.arch.vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config.model: the draft model's vocabulary ({ckpt.arch.vocab_size} tokens) is "
                         f"not the target model's ({target_vocab_size} tokens); a draft model must share its tokenizer")
    if target_vocab is not None:
        try:
            draft_vocab: dict[str, int] | None = Tokenizer.from_model_path(where).vocabulary()
        except (LoadError, OSError, ValueError):
            draft_vocab = None  # a checkpoint without a tokenizer: the sizes matched, which is all there is to check
        if draft_vocab is not None and draft_vocab != target_vocab:
            tokens = sorted(t for t in draft_vocab.keys() | target_vocab.keys() if draft_vocab.get(t) != target_vocab.get(t))
            differ = "; ".join(f"{t!r}: draft {draft_vocab.get(t)}, target {target_vocab.get(t)}" for t in tokens[:3])
            raise ValueError(f"speculative_config.model: the draft model's tokenizer maps tokens to other ids than the "
                             f"target's (for example {differ}); a draft model must share its tokenizer")
    return Drafter(ckpt.arch, ckpt.weights, block_size=block_size, dtype=dtype, device=device, q4_1=ckpt.q4_1)
