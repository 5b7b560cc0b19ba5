"""The model side of an engine step (nano-vllm's ModelRunner): the KV pool, the attention backend, the forward pass
over the scheduled chunks, the structured-output masks and sampling.

Runs on the engine thread only (warm-up: the thread that starts the engine). It knows nothing of a request's
lifecycle (worker/engine/engine.py) or of who holds which page (radixcache.cache, worker/engine/scheduler/): it
computes the chunks it is given into the pages their leases name, hands the step's logits back chunk by chunk
(ChunkRows), and appends the sampled token to a sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixcache.cache_base import BaseCache
from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import AttentionBackend, BatchLayout, SequenceSlice
from radixcache.worker.attention.base import create_backend
from radixcache.worker.engine.config import DEFAULT_KV_MEMORY, EngineConfig
from radixcache.worker.engine.request import FinishReason
from radixcache.worker.engine.row_check import RowCheck, check_rows
from radixcache.worker.engine.sampling import apply_penalties, sample_row, token_logprob
from radixcache.worker.engine.scheduler import Chunk
from radixcache.worker.engine.sequence import Sequence
from radixcache.worker.engine.structured import GrammarCache
from radixcache.worker.engine.warmup import warm_up
from radixcache.worker.model.config import ModelConfig
from radixcache.worker.model.llama import attention_options
from radixcache.worker.model.loader import LoadedModel

log = logging.getLogger("radixcache.engine")


@dataclass(frozen=True, slots=True)
class WindowPaging:
    """The sliding layers whose values are paged apart (radixcache.window_parts) and their window W; no layers and
    W = 0 when every layer is in the page."""

    layers: tuple[int, ...] = ()
    window: int = 0


def window_paging(model_config: ModelConfig, config: EngineConfig) -> WindowPaging:
    """kv_window_paging auto pages the sliding layers apart whenever some layer slides and neither demotion nor a
    tier below memory (which move whole pages) is on; "on" with those is refused by EngineConfig. Several windows:
    the largest (each layer still reads only its own)."""
    windows = attention_options(model_config).windows
    sliding = tuple(i for i, w in enumerate(windows) if w is not None)
    if not sliding or config.kv_window_paging == "off" or config.moves_whole_pages:
        return WindowPaging()
    return WindowPaging(sliding, max(w for w in windows if w is not None))


def window_slots_needed(config: EngineConfig, window: int) -> int:
    """Window slots that every running sequence's window can need at once: per sequence the pages of its last
    W - 1 positions (+1 for a window that straddles a page, +1 for a partial hit's copy source, +2 for the pages its
    step and draft start in), and the pages of a full step's new tokens and drafts. A quarter more, so that the tree
    keeps idle windows to continue from. A pool with fewer pages than this gives every page its window part."""
    ps = config.page_size
    per_sequence = -(-(window - 1) // ps) + 4
    step = -(-(config.max_step_tokens + config.max_running * config.speculate) // ps)
    needed = config.max_running * per_sequence + step
    return needed + needed // 4


def check_latent_pages(model_config: ModelConfig, config: EngineConfig) -> None:
    """Latent (MLA) pages take every kv_dtype but int4: int4 stores keys Hadamard-rotated, and the first half of a
    latent, which a write hands the pool as its "key", is also its value (a latent is read whole, as key and value).
    int8 keeps a scale per half of each latent (per token), fp8_e4m3 one per-layer scale for the whole latent
    (radixcache/pool.py, latent pages). Demotion keeps its int4 copies unread (a hit brings them back into the
    pool's own precision first), so it is allowed. ValueError naming the option."""
    if model_config.is_mla and config.kv_dtype == "int4":
        raise ValueError(
            f"kv_dtype (--kv-dtype) int4: {model_config.architecture} caches latent (MLA) pages, which int4's rotated "
            "keys cannot hold; use --kv-dtype int8, fp8_e4m3 or the model's precision"
        )


def build_pool(loaded: LoadedModel, config: EngineConfig) -> KVPool:
    """The KV pool for `loaded`'s model on its device, at config.kv_dtype (auto: the model's dtype): kv_pages
    exactly, or as many pages as kv_memory_bytes holds (scales included, so a smaller precision buys more pages).
    A model with sliding layers gets them paged apart (window_paging), with window_slots_needed slots; an MLA
    model gets latent pages (token-contiguous latents: radixcache/pool.py)."""
    param = next(loaded.model.parameters())
    mc = loaded.config
    assert mc.head_dim is not None, "ModelConfig derives head_dim when the checkpoint leaves it out"
    kv_heads, head_dim = mc.kv_cache_dims  # an MLA model's latent pages: (1, D / 2), a token's latent two half-rows
    shape = KVShape(layers=mc.num_layers, kv_heads=kv_heads, head_dim=head_dim)
    kv_dtype = param.dtype if config.kv_dtype == "auto" else config.kv_dtype
    check_latent_pages(mc, config)
    paging = window_paging(mc, config)
    if paging.layers:
        return KVPool.with_windows(
            shape,
            page_size=config.page_size,
            num_pages=config.kv_pages,
            budget_bytes=None if config.kv_pages is not None else config.kv_memory_bytes or DEFAULT_KV_MEMORY,
            dtype=kv_dtype,
            device=param.device,
            window_layers=paging.layers,
            slots_needed=window_slots_needed(config, paging.window),
        )
    if config.kv_demote is not None:  # the same memory, split: kv_demote_share of it for demoted pages
        per_page = KVPool.bytes_per_page(shape, config.page_size, kv_dtype)
        budget = config.kv_pages * per_page if config.kv_pages is not None else config.kv_memory_bytes
        return KVPool.with_demotion(
            shape,
            page_size=config.page_size,
            budget_bytes=budget or DEFAULT_KV_MEMORY,
            dtype=kv_dtype,
            demote_dtype=config.kv_demote,
            demote_share=config.kv_demote_share,
            device=param.device,
            latent=mc.is_mla,
        )
    if config.kv_pages is not None:
        return KVPool(
            shape, page_size=config.page_size, num_pages=config.kv_pages, dtype=kv_dtype, device=param.device,
            latent=mc.is_mla,
        )  # fmt: skip
    return KVPool.from_budget(
        shape,
        page_size=config.page_size,
        budget_bytes=config.kv_memory_bytes or DEFAULT_KV_MEMORY,
        dtype=kv_dtype,
        device=param.device,
        latent=mc.is_mla,
    )


@dataclass(slots=True)  # one per chunk each step: not frozen (a frozen __init__ costs ~5x)
class ChunkRows:
    """One chunk's rows of a step's logits: row 0 is the distribution after its last new token, row i after its
    draft token i-1 (chunk.num_rows rows from `first`). `allowed`: row 0 with the tokens its grammar forbids at
    -inf (constrained chunks that sample; None otherwise)."""

    logits: torch.Tensor  # the whole step's, float32 on the CPU
    finite: list[bool]  # per row of the whole step: no inf or nan in it
    first: int
    allowed: torch.Tensor | None

    def row(self, i: int) -> torch.Tensor:
        """Row i, checked: FloatingPointError if the model gave non-finite logits there."""
        if not self.finite[self.first + i]:
            raise FloatingPointError("non-finite logits")
        return self.logits[self.first + i]


class ModelStep:
    """Forward and sample for the engine. `eos_ids`: the tokens that end a sequence (the model's and tokenizer's)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, eos_ids: set[int]) -> None:
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.backend_choice = config.backend
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.page_size = config.page_size
        self.pool = build_pool(loaded, config)
        # the sliding layers' window when they are paged apart (0: every layer in the page)
        self.window = window_paging(mc, config).window if self.pool.window is not None else 0
        # set by the engine with window paging: pages -> their window slots (PrefixCache.window_slots)
        self.window_slots: Callable[[list[int]], list[int]] | None = None
        self.backend_options = dict(
            num_heads=mc.num_heads,
            num_kv_heads=mc.kv_cache_dims[0],
            head_dim=mc.kv_cache_dims[1],
            dtype=self.dtype,
            attention=attention_options(mc),
            kv_dtype=self.pool.kv_dtype,
        )
        self.backend: AttentionBackend = create_backend(config.backend, self.device, **self.backend_options)
        # Structured outputs: grammars compile on the submitting thread, masks are applied on the engine thread.
        self.grammars = GrammarCache(loaded.tokenizer, mc.vocab_size, eos_ids)
        self.context_length = mc.max_position_embeddings

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """float32 logits on the CPU, chunk.num_rows rows per chunk in chunk order (see `first_rows`): the
        next-token distribution after its last new token, then after each of its draft tokens."""
        ids: list[int] = []
        slices = []
        rows: list[int] = []
        for c in chunks:
            start = c.seq.num_computed
            ids.extend(c.seq.tokens[start : start + c.num_new])
            ids.extend(c.draft)
            rows.extend(range(len(ids) - c.num_rows, len(ids)))
            assert c.seq.lease is not None, f"{c.seq.name} is scheduled without a lease"
            pages = c.seq.lease.pages
            slots = self.window_slots(pages) if self.window_slots is not None else None
            slices.append(SequenceSlice(pages, start, c.num_tokens, slots))
        layout = BatchLayout.build(slices, self.page_size, self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        wanted = torch.tensor(rows, device=self.device) if len(rows) > len(chunks) else None  # None: a row each
        return self.model(input_ids, layout, self.pool, self.backend, rows=wanted).float().cpu()

    def rows(self, chunks: list[Chunk], logits: torch.Tensor) -> list[ChunkRows]:
        """`forward`'s logits, chunk by chunk (the finite check and the grammar masks done for the whole batch)."""
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # one pass for the batch, not one per row
        allowed = self.constrained_logits(chunks, logits)
        return [ChunkRows(logits, finite, first, allowed.get(i)) for i, first in enumerate(self.first_rows(chunks))]

    @staticmethod
    def first_rows(chunks: list[Chunk]) -> list[int]:
        """Each chunk's first row in `forward`'s logits."""
        out, row = [], 0
        for c in chunks:
            out.append(row)
            row += c.num_rows
        return out

    def constrained_logits(self, chunks: list[Chunk], logits: torch.Tensor) -> dict[int, torch.Tensor]:
        """Chunk index -> its first row's logits with the tokens its grammar forbids at -inf, for the constrained
        chunks that sample this step (all masks of the batch in one call). Draft rows need the grammar state after
        the accepted tokens: `constrained_row`."""
        firsts = self.first_rows(chunks)
        wanted = [(i, c.seq.matcher) for i, c in enumerate(chunks) if c.seq.matcher is not None and c.samples]
        if not wanted:
            return {}
        masked = self.grammars.mask_logits(logits, [firsts[i] for i, _ in wanted], [m for _, m in wanted])
        return {i: row for (i, _), row in zip(wanted, masked, strict=True)}

    def constrained_row(self, seq: Sequence, row: torch.Tensor) -> torch.Tensor | None:
        """One row of logits masked by seq's grammar in its current state; None when seq is unconstrained."""
        if seq.matcher is None:
            return None
        return self.grammars.mask_logits(row[None], [0], [seq.matcher])[0]

    def sample(self, seq: Sequence, logits: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """Append seq's next token, sampled from `allowed` (the constrained logits) when given; logprobs stay those
        of the model's logits. A sequence that reaches the context length ends with LENGTH."""
        params = seq.request.sampling
        base = logits if allowed is None else allowed
        token = sample_row(apply_penalties(base, seq.generated, params), params, seq.generator)
        logprob = token_logprob(logits, token, params.top_logprobs) if params.logprobs else None
        seq.append_token(token, logprob)
        if seq.finish_reason is None and len(seq.tokens) >= self.context_length:
            seq.finish_reason = FinishReason.LENGTH

    def check_rows(self, cache: BaseCache, vocab: int, context: int) -> RowCheck:
        """The start-up row check on this model, pool and backend (worker/engine/row_check.py)."""
        return check_rows(self.model, self.pool, cache, self.backend, vocab, context)

    def warm_up(self, cache: BaseCache) -> None:
        """A short prefill, a decode and a mixed batch (worker/engine/warmup.py), so kernels compile before any request.
        Under backend 'auto', a backend other than torch that fails them is replaced by torch, with a warning;
        an explicit one raises RuntimeError."""
        try:
            warm_up(self.model, self.pool, cache, self.backend)
        except Exception as exc:
            if self.backend.name == "torch":
                raise
            if self.backend_choice != "auto":
                raise RuntimeError(
                    f"attention backend {self.backend.name!r} failed its start-up warm-up ({type(exc).__name__}: "
                    f"{exc}); use backend 'auto' or 'torch'"
                ) from exc
            log.warning(
                "attention backend %s failed its start-up warm-up (%s: %s); falling back to the torch backend",
                self.backend.name, type(exc).__name__, exc, exc_info=True,
            )  # fmt: skip
            self.backend = create_backend("torch", self.device, **self.backend_options)
            warm_up(self.model, self.pool, cache, self.backend)
