"""Parity with Hugging Face transformers on the same weights: greedy tokens identical, fp32 logits within 1e-4.

Every supported architecture x page size (1, 7, 16) runs: a cold cache, a warm hit on whole pages, a hit ending
inside a page (copy-on-write of its first k slots), chunked prefill with chunks that straddle page boundaries, a
mixed batch where one sequence decodes while another prefills on top of a cached prefix, and a sequence preempted
mid-generation and recomputed (prompt and generated tokens, chunked, on a cached prefix). The sliding-window
fixtures (Mistral, Gemma 2/3: window 8) make every sequence span several windows and every hit (22 tokens) longer
than the window. The cache is simulated by hand: page ids come from a counter and block tables are assembled here,
so this test does not depend on PrefixCache.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from model_fixtures import build_checkpoint, hf_greedy

from radixcache.pool import KVPool, KVShape
from radixcache.worker.attention import BatchLayout, SequenceSlice, create_backend
from radixcache.worker.model import SUPPORTED_ARCHITECTURES, load_checkpoint
from radixcache.worker.model.llama import attention_options

ARCHS = list(SUPPORTED_ARCHITECTURES)
PAGE_SIZES = [1, 7, 16]
MAX_NEW = 24
SHARED = 22  # tokens prompt B shares with prompt A: 1 page + 6 slots at page size 16, 3 + 1 at 7
ATOL = 1e-4
MIN_MARGIN = 1e-3  # top-1 minus top-2 reference logit at every compared position: ties cannot flip a token


@dataclass
class Reference:
    prompt: list[int]
    tokens: list[int]  # greedy continuation by transformers
    logits: torch.Tensor  # [len(prompt) + MAX_NEW - 1, vocab]: row i predicts token i + 1


@dataclass
class Setup:
    loaded: object
    refs: dict[str, Reference]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> object:
    # Tiny matmuls gain nothing from threads, and on a busy 2-core machine thread hand-offs cost ~50x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=ARCHS)
def setup(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Setup:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_checkpoint(folder, request.param, seed=1)
    hf.config._attn_implementation = "eager"
    loaded = load_checkpoint(folder)
    tok = loaded.tokenizer
    a = tok.encode("a prefix cache shares pages between requests that start the same way")
    b = a[:SHARED] + tok.encode(" the quick brown fox jumps over", add_special_tokens=False)
    assert len(a) > 2 * 16 and len(b) > SHARED + 4 and a[SHARED] != b[SHARED]
    window = loaded.config.sliding_window
    assert window is None or len(a) > 4 * window and SHARED > 2 * window  # several windows; hits past the window
    refs = {}
    for name, prompt in (("a", a), ("b", b)):
        tokens, logits = hf_greedy(hf, prompt, MAX_NEW)
        top2 = logits[len(prompt) - 1 :].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > MIN_MARGIN, f"reference logits too flat for a stable greedy comparison ({margin})"
        refs[name] = Reference(prompt, tokens, logits)
    return Setup(loaded, refs)


@dataclass
class Seq:
    ref: Reference
    pages: list[int]
    computed: int = 0  # tokens whose K/V is in the pages
    chunks: itertools.cycle | None = None  # prefill chunk sizes; None = the whole prompt at once
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.ref.prompt + self.generated


class Runner:
    """Drives the model step by step like the engine would, with page ids from a counter."""

    def __init__(self, loaded: object, page_size: int) -> None:
        cfg = loaded.config
        self.model, self.page_size = loaded.model, page_size
        shape = KVShape(cfg.num_layers, *cfg.kv_cache_dims)
        self.pool = KVPool(shape, page_size=page_size, num_pages=600, latent=cfg.is_mla)
        self.backend = create_backend("torch", attention=attention_options(cfg))
        self.next_page = 0

    def alloc(self, n: int) -> list[int]:
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        return pages

    def run(self, *seqs: Seq, until: int = MAX_NEW) -> None:
        """Step the sequences together until each has `until` generated tokens."""
        while not all(len(s.generated) >= until for s in seqs):
            active = [s for s in seqs if len(s.generated) < until]
            slices, ids = [], []
            for s in active:
                remaining = len(s.tokens) - s.computed  # known tokens whose K/V is not in the pages yet
                n = remaining if s.chunks is None or remaining == 1 else min(next(s.chunks), remaining)
                need = -(-(s.computed + n) // self.page_size)
                s.pages.extend(self.alloc(need - len(s.pages)) if need > len(s.pages) else [])
                slices.append(SequenceSlice(list(s.pages), s.computed, n))
                ids.extend(s.tokens[s.computed : s.computed + n])
            layout = BatchLayout.build(slices, self.page_size)
            with torch.no_grad():
                logits = self.model(torch.tensor(ids), layout, self.pool, self.backend)
            for row, (s, sl) in enumerate(zip(active, slices, strict=True)):
                s.computed += sl.num_new
                if s.computed == len(s.tokens):  # the last known token was computed: its row predicts the next
                    s.logits.append(logits[row])
                    s.generated.append(int(logits[row].argmax()))

    def cached_prefix(self, source: Seq, num_tokens: int) -> Seq:
        """A block table that reuses `source`'s pages for its first num_tokens tokens (copy-on-write of a
        partly shared last page), as PrefixCache.acquire + the engine's copy_from step would set it up."""
        full, rest = divmod(num_tokens, self.page_size)
        pages = source.pages[:full]
        if rest:
            fresh = self.alloc(1)[0]
            self.pool.copy_prefix(source.pages[full], fresh, rest)
            pages = pages + [fresh]
        return pages


def check(seq: Seq) -> None:
    ref = seq.ref
    assert seq.generated == ref.tokens
    got = torch.stack(seq.logits)
    want = ref.logits[len(ref.prompt) - 1 :]
    err = float((got - want).abs().max())
    assert err < ATOL, f"max abs logit error {err}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_cold_cache(setup: Setup, page_size: int) -> None:
    runner = Runner(setup.loaded, page_size)
    a = Seq(setup.refs["a"], pages=[])
    runner.run(a)
    check(a)


@pytest.mark.parametrize("page_size", [1, 16])
def test_warm_full_page_hit(setup: Setup, page_size: int) -> None:
    runner = Runner(setup.loaded, page_size)
    a = Seq(setup.refs["a"], pages=[])
    runner.run(a)
    shared_pages = a.pages[: SHARED // page_size]
    before = runner.pool.kv[:, shared_pages].clone()
    cached = (SHARED // page_size) * page_size
    b = Seq(setup.refs["b"], pages=runner.cached_prefix(a, cached), computed=cached)
    runner.run(b)
    check(b)
    assert b.pages[: len(shared_pages)] == shared_pages
    assert torch.equal(runner.pool.kv[:, shared_pages], before), "a reader wrote into shared pages"


@pytest.mark.parametrize("page_size", [7, 16])  # at page size 1 every hit ends on a page boundary
def test_hit_ending_mid_page(setup: Setup, page_size: int) -> None:
    runner = Runner(setup.loaded, page_size)
    a = Seq(setup.refs["a"], pages=[])
    runner.run(a)
    before = runner.pool.kv[:, a.pages].clone()
    b = Seq(setup.refs["b"], pages=runner.cached_prefix(a, SHARED), computed=SHARED)
    full = SHARED // page_size
    assert SHARED % page_size and b.pages[:full] == a.pages[:full] and b.pages[full] not in a.pages
    runner.run(b)
    check(b)
    assert torch.equal(runner.pool.kv[:, a.pages], before), "the partly shared page was written in place"


@pytest.mark.parametrize("page_size", [7, 16])
def test_chunked_prefill_unaligned(setup: Setup, page_size: int) -> None:
    runner = Runner(setup.loaded, page_size)
    a = Seq(setup.refs["a"], pages=[], chunks=itertools.cycle([7, 5, 11]))
    runner.run(a)
    check(a)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_mixed_batch_prefill_and_decode(setup: Setup, page_size: int) -> None:
    runner = Runner(setup.loaded, page_size)
    first = Seq(setup.refs["a"], pages=[])
    runner.run(first)
    # One batch: a cold sequence prefilling in big chunks (then decoding) next to a warm one prefilling in small
    # chunks on top of a cached prefix that ends mid-page -> steps mix prefill chunks and decodes.
    a = Seq(setup.refs["a"], pages=[], chunks=itertools.cycle([13]))
    b = Seq(setup.refs["b"], pages=runner.cached_prefix(first, SHARED), computed=SHARED, chunks=itertools.cycle([3]))
    runner.run(a, b)
    check(a)
    check(b)


@pytest.mark.parametrize("page_size", [7])
def test_preempted_and_recomputed(setup: Setup, page_size: int) -> None:
    """Preemption by recompute: a sequence stops after 9 tokens and loses its pages but the first SHARED tokens'
    (as if the rest were evicted); it resumes by prefilling its prompt and generated tokens in chunks of 5 on top of
    that hit, next to another sequence decoding, and ends as transformers does."""
    runner = Runner(setup.loaded, page_size)
    a, other = Seq(setup.refs["a"], pages=[]), Seq(setup.refs["b"], pages=[])
    runner.run(a, other, until=9)
    resumed = Seq(
        a.ref, pages=runner.cached_prefix(a, SHARED), computed=SHARED, chunks=itertools.cycle([5]),
        generated=list(a.generated), logits=list(a.logits),
    )  # fmt: skip
    runner.run(resumed, other)
    check(resumed)
    check(other)
