"""Train the embedded default model shipped in worker/default_model/.

Everything comes from the machine itself, so the script runs offline: the corpus is the English documentation
that ships inside CPython's standard library (the pydoc topics in ``pydoc_data.topics`` and every module, class
and function docstring of the stdlib's .py files, read with ``ast`` so nothing is imported or executed).
Documents are sorted, so for a given Python version the corpus is the same on every run; a document goes to the
validation split when a hash of its name (not its text) says so, so the split is stable across Python versions
too. A byte-level BPE tokenizer is trained with ``tokenizers`` on the training split, then a small
LlamaForCausalLM (GQA, tied embeddings) is trained with AdamW and a cosine schedule for a fixed number of steps
from a fixed seed, and saved in Hugging Face format (bf16 weights) with a model card.

    .venv/bin/python scripts/train_default_model.py            # full run, ~20 min on 2 cores
    .venv/bin/python scripts/train_default_model.py --steps 20 --out /tmp/smoke   # smoke test

The corpus and split helpers (``build_documents``, ``split_documents``, ``validation_token_stream``) are also
used by tests/test_default_model.py to rebuild the held-out text.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "worker" / "default_model"

BOS = "<|bos|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
# Order fixes the ids: <|endoftext|>=0, <|bos|>=1, <|pad|>=2, <|system|>=3, <|user|>=4, <|assistant|>=5, <|end|>=6.
SPECIAL_TOKENS = [EOS, BOS, PAD, SYSTEM, USER, ASSISTANT, END]

# Every turn renders as "<|role|>\ncontent<|end|>\n" after one leading <|bos|>. Earlier turns never depend on
# later ones, so appending a message only appends text: the rendered turn N+1 starts with turn N's prompt plus
# the reply, which is what lets a serving cache reuse the whole previous conversation.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "turtledemo"}
VALIDATION_PERCENT = 5


# ----------------------------------------------------------------------------------------------------------------
# Corpus


def _clean(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text)


def build_documents() -> list[tuple[str, str]]:
    """Return sorted (name, text) documents from CPython's own documentation; no imports, no execution."""
    docs: dict[str, str] = {}
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = _clean(topics[key])
        if len(text) >= 40:
            docs[f"topic:{key}"] = text

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        for fname in sorted(files):
            if not fname.endswith(".py"):
                continue
            path = Path(root) / fname
            module = ".".join(path.relative_to(stdlib).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            _collect_docstrings(tree, module, docs)
    return sorted(docs.items())


def _collect_docstrings(node: ast.AST, qualname: str, docs: dict[str, str]) -> None:
    doc = ast.get_docstring(node, clean=True)
    if doc:
        text = _clean(doc)
        if len(text) >= 40 and qualname not in docs:
            docs[qualname] = text
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            _collect_docstrings(child, f"{qualname}.{child.name}", docs)


def is_validation(name: str) -> bool:
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < VALIDATION_PERCENT


def split_documents(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    train = [d for d in docs if not is_validation(d[0])]
    val = [d for d in docs if is_validation(d[0])]
    return train, val


_SENTENCE = re.compile(r"^(.{20,300}?[.!?])(\s|$)", re.S)


def chat_examples(train: list[tuple[str, str]], rng: random.Random, limit: int) -> list[str]:
    """Cheap chat-formatted text from the training docs: a question about a name, answered by its first sentence."""
    out = []
    for name, text in train:
        if name.startswith("topic:"):
            subject = name.split(":", 1)[1].replace("-", " ")
            question = rng.choice(["What is {}?", "Explain {}.", "Tell me about {}.", "How does {} work?"])
        else:
            if any(part.startswith("_") for part in name.split(".")):
                continue
            subject = name
            question = rng.choice(["What does {} do?", "What is {}?", "Describe {}.", "Explain {} briefly."])
        first = " ".join(text.split("\n\n", 1)[0].split())
        m = _SENTENCE.match(first)
        if not m:
            continue
        convo = [("user", question.format(subject)), ("assistant", m.group(1))]
        if rng.random() < 0.3:
            convo.insert(0, ("system", "You are a helpful assistant that knows the Python documentation."))
        out.append(BOS + "".join(f"<|{role}|>\n{content}{END}\n" for role, content in convo))
    rng.shuffle(out)
    return out[:limit]


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    add_bos(tok)
    return tok


def add_bos(tok) -> None:
    """Plain-text prompts start with BOS, as every training document did: encode(add_special_tokens=True) adds it
    (the chat template writes its own BOS and is encoded without special tokens)."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )


def _byte_decoder() -> dict[str, int]:
    # The GPT-2 byte <-> printable-unicode table that tokenizers' ByteLevel uses.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_byte_lengths(tok) -> list[int]:
    """UTF-8 bytes each token stands for (0 for special tokens), for bits-per-byte."""
    dec = _byte_decoder()
    special = set(SPECIAL_TOKENS)
    lengths = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i)
        lengths.append(0 if piece in special else sum(1 for ch in piece if ch in dec))
    return lengths


def encode_documents(tok, texts: list[str], wrap: bool = True) -> list[int]:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(([bos] if wrap else []) + enc.ids + [eos])
    return ids


def validation_token_stream(tok, val_docs: list[tuple[str, str]]) -> list[int]:
    return encode_documents(tok, [text for _, text in val_docs])


# ----------------------------------------------------------------------------------------------------------------
# Evaluation (shared with the test)


def evaluate(model, ids: list[int], byte_lengths: list[int], seq_len: int, max_windows: int | None = None) -> dict:
    """Mean NLL over non-overlapping windows: returns nats/bits per token and bits per byte of predicted tokens."""
    import torch

    model.eval()
    nll = 0.0
    n_tok = 0
    n_bytes = 0
    blen = torch.tensor(byte_lengths)
    windows = [ids[i : i + seq_len] for i in range(0, len(ids) - 1, seq_len)]
    windows = [w for w in windows if len(w) > 1][:max_windows]
    with torch.no_grad():
        for start in range(0, len(windows), 8):
            batch = windows[start : start + 8]
            width = max(len(w) for w in batch)
            x = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for r, w in enumerate(batch):
                x[r, : len(w)] = torch.tensor(w)
                mask[r, : len(w)] = 1
            logits = model(input_ids=x, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            target = x[:, 1:]
            valid = mask[:, 1:].bool()
            tok_nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            nll += tok_nll[valid].sum().item()
            n_tok += int(valid.sum())
            n_bytes += int(blen[target][valid].sum())
    return {
        "tokens": n_tok,
        "bytes": n_bytes,
        "nats_per_token": nll / n_tok,
        "bits_per_token": nll / n_tok / math.log(2),
        "bits_per_byte": nll / math.log(2) / n_bytes,
    }


# ----------------------------------------------------------------------------------------------------------------
# Training


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-fraction", type=float, default=0.08, help="share of training text that is chat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()

    docs = build_documents()
    train_docs, val_docs = split_documents(docs)
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    val_bytes = sum(len(t.encode()) for _, t in val_docs)
    print(
        f"corpus: {len(docs)} documents from Python {sys.version.split()[0]}; train {len(train_docs)} docs "
        f"{train_bytes / 1e6:.2f} MB, validation {len(val_docs)} docs {val_bytes / 1e6:.3f} MB",
        flush=True,
    )

    rng = random.Random(args.seed)
    # Budget the chat examples as a share of the training bytes.
    chats = chat_examples(train_docs, rng, limit=10**9)
    chat_budget = args.chat_fraction * train_bytes
    kept, used = [], 0
    for c in chats:
        if used >= chat_budget:
            break
        kept.append(c)
        used += len(c.encode())
    chats = kept

    tok = train_tokenizer([t for _, t in train_docs] + chats, args.vocab_size)
    vocab = tok.get_vocab_size()
    ids_of = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    print(f"tokenizer: byte-level BPE, vocab {vocab}, special {ids_of}", flush=True)

    # Training stream: shuffled documents (plain ones wrapped <|bos|>..<|endoftext|>, chats already carry <|bos|>).
    texts = [t for _, t in train_docs]
    plain = encode_documents(tok, texts)
    chat_ids = encode_documents(tok, chats, wrap=False)
    order = [("doc", t) for t in texts] + [("chat", c) for c in chats]
    rng.shuffle(order)
    stream: list[int] = []
    bos, eos = ids_of[BOS], ids_of[EOS]
    for kind, enc in zip(
        [k for k, _ in order],
        tok.encode_batch([t for _, t in order], add_special_tokens=False),
        strict=True,
    ):
        stream.extend(([bos] if kind == "doc" else []) + enc.ids + [eos])
    data = torch.tensor(stream, dtype=torch.long)
    print(
        f"train tokens: {len(stream)} ({len(plain)} docs + {len(chat_ids)} chat, {len(chats)} conversations), "
        f"{train_bytes / max(1, len(plain)):.2f} bytes/token",
        flush=True,
    )
    val_ids = validation_token_stream(tok, val_docs)
    byte_lengths = token_byte_lengths(tok)

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=ids_of[PAD],
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters ({n_params / 1e6:.2f} M)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    n_windows = (len(data) - 1) // args.seq_len
    perm = torch.randperm(n_windows, generator=gen)
    cursor = 0
    epoch = 0
    t_train = time.time()
    model.train()
    running = None
    for step in range(args.steps):
        if cursor + args.batch_size > n_windows:
            perm = torch.randperm(n_windows, generator=gen)
            cursor = 0
            epoch += 1
        # Random offset inside each window so epochs do not repeat the exact same chunks.
        shift = int(torch.randint(0, args.seq_len, (1,), generator=gen)) if epoch else 0
        starts = [
            (int(w) * args.seq_len + shift) % (len(data) - args.seq_len - 1)
            for w in perm[cursor : cursor + args.batch_size]
        ]
        cursor += args.batch_size
        x = torch.stack([data[s : s + args.seq_len + 1] for s in starts])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}/{args.steps} epoch {epoch} loss {loss.item():.4f} (avg {running:.4f}) "
                f"lr {lr_at(step):.2e} {el:.0f}s ({(step + 1) * args.batch_size * args.seq_len / el:.0f} tok/s)",
                flush=True,
            )
        if step and step % 250 == 0:
            m = evaluate(model, val_ids, byte_lengths, args.seq_len)
            print(f"  val: {m['bits_per_token']:.3f} bits/token, {m['bits_per_byte']:.3f} bits/byte", flush=True)
            model.train()
    train_seconds = time.time() - t_train

    # Ship bf16 weights and report the loss of exactly what ships (bf16 weights, fp32 compute).
    model = model.to(torch.bfloat16)
    shipped = LlamaForCausalLM(config)
    shipped.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    metrics = evaluate(shipped, val_ids, byte_lengths, args.seq_len)
    print(
        f"validation (bf16 weights): {metrics['bits_per_token']:.4f} bits/token, "
        f"{metrics['nats_per_token']:.4f} nats/token, {metrics['bits_per_byte']:.4f} bits/byte "
        f"over {metrics['tokens']} tokens / {metrics['bytes']} bytes",
        flush=True,
    )

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.config.torch_dtype = "bfloat16"
    model.generation_config.bos_token_id = bos
    model.generation_config.eos_token_id = [eos, ids_of[END]]
    model.generation_config.pad_token_id = ids_of[PAD]
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"  # both spellings, for loaders written against transformers 4 or 5
    cfg["dtype"] = "bfloat16"
    cfg["rope_theta"] = 10000.0  # transformers 5 nests it in rope_parameters; older readers look here
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        model_max_length=args.seq_len,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE  # inline, so a plain json + jinja2 reader finds it
    tc["add_bos_token"] = False
    tc.pop("auto_map", None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # known to transformers 4 and 5
    tc["additional_special_tokens"] = [SYSTEM, USER, ASSISTANT, END]
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    if (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").unlink()

    samples = sample_continuations(shipped, fast, args.seed)
    for s in samples:
        print(f"--- {s['mode']}: {s['prompt']!r}\n{s['text']}", flush=True)

    total = time.time() - t_start
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "__init__.py")
    write_card(
        out,
        args,
        config,
        n_params,
        vocab,
        ids_of,
        len(docs),
        len(train_docs),
        len(val_docs),
        train_bytes,
        val_bytes,
        len(stream),
        len(chats),
        metrics,
        train_seconds,
        total,
        running,
        samples,
        size,
    )
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "__init__.py")
    print(f"wrote {out}: {size / 1e6:.2f} MB; training {train_seconds:.0f}s, total {total:.0f}s", flush=True)


def sample_continuations(model, tok, seed: int) -> list[dict]:
    import torch

    prompts = [
        "The for statement is used to",
        "Return a new list",
        "This module provides",
        "An exception is raised when",
    ]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What does json.dumps do?"}], tokenize=False, add_generation_prompt=True
    )
    out = []
    model.eval()
    torch.manual_seed(seed)
    cases = [(p, "greedy") for p in prompts] + [(p, "temperature 0.8, top-p 0.95") for p in prompts[:3]]
    cases.append((chat, "greedy (chat template)"))
    for prompt, mode in cases:
        text = prompt if prompt.startswith(BOS) else BOS + prompt
        x = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            kwargs = (
                {"do_sample": False}
                if mode.startswith("greedy")
                else {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0}
            )
            y = model.generate(
                x,
                max_new_tokens=48,
                eos_token_id=[tok.convert_tokens_to_ids(END), tok.eos_token_id],
                pad_token_id=tok.pad_token_id,
                **kwargs,
            )
        cont = tok.decode(y[0, x.shape[1] :], skip_special_tokens=False)
        out.append({"prompt": prompt, "mode": mode, "text": cont})
    return out


def write_card(
    out,
    args,
    config,
    n_params,
    vocab,
    ids_of,
    n_docs,
    n_train,
    n_val,
    train_bytes,
    val_bytes,
    n_tokens,
    n_chats,
    metrics,
    train_seconds,
    total,
    final_loss,
    samples,
    size,
) -> None:
    cmd = "python scripts/train_default_model.py" + (
        "" if sys.argv[1:] == [] else " " + " ".join(a for a in sys.argv[1:])
    )
    sample_md = "\n".join(
        f"- **{s['mode']}**, prompt `{s['prompt']!r}`:\n\n  ```\n  {s['text']!r}\n  ```" for s in samples
    )
    specials = ", ".join(f"`{k}`={v}" for k, v in ids_of.items())
    card = f"""# radixcache default model

A tiny Llama-architecture causal LM shipped inside the package so `radixcache serve` / `make run` stream real
English-ish words on any CPU, with no model hub. It is a toy: it continues Python-documentation-style prose and
answers chat prompts in that style; it knows nothing reliable.

## Data
The English documentation inside CPython's standard library (Python {sys.version.split()[0]}): the
`pydoc_data.topics` pages and every module, class and function docstring of the stdlib `.py` files (parsed with
`ast`, no imports), sorted by name. {n_docs} documents; a document whose SHA-256(name) mod 100 < {VALIDATION_PERCENT}
is held out: {n_train} training documents ({train_bytes / 1e6:.2f} MB), {n_val} validation documents
({val_bytes / 1e6:.3f} MB). About {args.chat_fraction:.0%} extra training text is {n_chats} chat-formatted
question/answer pairs made from the training documents (question about a name, answer = its first sentence).

## Tokenizer
Byte-level BPE trained with `tokenizers` on the training split, vocabulary {vocab}. Special tokens: {specials}.
`bos_token` = `<|bos|>`, `eos_token` = `<|endoftext|>`, `pad_token` = `<|pad|>`; generation stops at
`<|endoftext|>` or `<|end|>` (generation_config.json). The tokenizer adds no special tokens by itself: plain
text prompts are best started with `<|bos|>`, which is how every training document started.

Chat template (each turn is `<|role|>\\ncontent<|end|>\\n` after one leading `<|bos|>`; appending a message
only appends text, so turn N+1's prompt starts with turn N's prompt plus the reply):

```jinja
{CHAT_TEMPLATE}
```

## Model
LlamaForCausalLM: hidden {config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads}
heads, {config.num_key_value_heads} KV heads (GQA), head dim {config.hidden_size // config.num_attention_heads},
intermediate {config.intermediate_size} (SwiGLU), RMSNorm eps {config.rms_norm_eps}, RoPE theta
{config.rope_theta if hasattr(config, "rope_theta") else 10000.0}, context {config.max_position_embeddings},
tied embeddings. **{n_params:,} parameters**, stored in bf16 ({size / 1e6:.2f} MB for the whole directory).

## Training
AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr}, {args.warmup} warmup
steps then cosine to {args.min_lr_ratio} x peak, gradient clipping 1.0, {args.steps} steps of
{args.batch_size} x {args.seq_len} tokens ({args.steps * args.batch_size * args.seq_len / 1e6:.2f} M tokens seen,
{n_tokens / 1e6:.2f} M tokens per epoch), fp32, seed {args.seed}, {args.threads} CPU threads. Training took
{train_seconds / 60:.1f} min ({total / 60:.1f} min including corpus and tokenizer). Final training loss (EMA)
{final_loss:.3f} nats/token.

Reproduce (deterministic for a given Python version, torch build and thread count):

```
{cmd}
```

## Validation
On the held-out documents, with the shipped bf16 weights (fp32 compute), non-overlapping {args.seq_len}-token
windows: **{metrics["bits_per_byte"]:.3f} bits per byte**, {metrics["bits_per_token"]:.3f} bits per token
({metrics["nats_per_token"]:.3f} nats/token) over {metrics["tokens"]} tokens / {metrics["bytes"]} bytes. A uniform
guess would be {math.log2(vocab):.1f} bits per token.

## Samples
Prompts are prefixed with `<|bos|>`; 48 new tokens at most.

{sample_md}
"""
    (out / "README.md").write_text(card)


if __name__ == "__main__":
    main()
