"""A small dataset in Megatron-LM's formats, made here (nothing downloaded), to try the main job's data
block (docs/usage.md) and for the tests:

    python scripts/pretrain_fixture.py OUT_DIR      (or: python -m megatron_opt_train.fixture OUT_DIR)
    -> OUT_DIR/gpt2-vocab.json, OUT_DIR/gpt2-merges.txt    a GPT-2-format BPE vocabulary and merges
       OUT_DIR/corpus_text_document.bin / .idx             tokenized documents, megatron-core's indexed format

The vocabulary is GPT-2's byte alphabet (each byte a symbol, printable ones as themselves), the
``--merges`` most frequent symbol pairs of the text (learned here, as BPE learns them) and
``<|endoftext|>``; the documents are the docstrings of Python's standard library (the main job's
built-in corpus), BPE-encoded with those merges and ended with ``<|endoftext|>``, written by
megatron-core's own IndexedDatasetBuilder (needs megatron-core and numpy).
"""
from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Optional, Sequence

from .components.data import build_corpus

EOD = "<|endoftext|>"
PREFIX = "corpus_text_document"  # tools/preprocess_data.py's "<output>_text_document"


def byte_symbols() -> list[str]:
    """GPT-2's byte alphabet: bytes that print as themselves keep their character, the other bytes get
    the characters from U+0100 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, extra = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def learn_merges(docs: list[list[str]], count: int) -> list[tuple[str, str]]:
    """The ``count`` BPE merges of ``docs`` (symbol sequences), most frequent pair first."""
    merges = []
    for _ in range(count):
        pairs = Counter(pair for doc in docs for pair in zip(doc, doc[1:]))
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        docs[:] = [apply_merge(doc, best) for doc in docs]
    return merges


def apply_merge(doc: list[str], pair: tuple[str, str]) -> list[str]:
    out, i = [], 0
    while i < len(doc):
        if i + 1 < len(doc) and (doc[i], doc[i + 1]) == pair:
            out.append(doc[i] + doc[i + 1])
            i += 2
        else:
            out.append(doc[i])
            i += 1
    return out


def documents(limit: int) -> list[str]:
    return [d for d in build_corpus().split("\n\n") if d.strip()][:limit]


def write_fixture(out_dir: str, merges: int = 40, limit: int = 600) -> str:
    """Write the vocabulary, merges and indexed dataset into ``out_dir``; returns the dataset prefix."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(out_dir, exist_ok=True)
    symbols = byte_symbols()
    docs = [[symbols[b] for b in text.encode("utf-8")] for text in documents(limit)]
    learned = learn_merges(docs, merges)  # docs are now encoded with them
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in learned:
        vocab[a + b] = len(vocab)
    vocab[EOD] = len(vocab)
    with open(os.path.join(out_dir, "gpt2-vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "gpt2-merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in learned))
    prefix = os.path.join(out_dir, PREFIX)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for doc in docs:
        ids = [vocab[s] for s in doc] + [vocab[EOD]]
        builder.add_document(numpy.array(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(prefix + ".idx")
    return prefix


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--merges", type=int, default=40, help="BPE merges to learn (default 40)")
    parser.add_argument("--documents", type=int, default=600, help="documents to write (default 600)")
    args = parser.parse_args(argv)
    prefix = write_fixture(args.out_dir, args.merges, args.documents)
    print(f"wrote {args.out_dir}/gpt2-vocab.json, gpt2-merges.txt and {prefix}.bin/.idx")


if __name__ == "__main__":
    main()
