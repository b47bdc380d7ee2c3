"""The main job's data: the built-in character corpus (the default: nothing to download), or
Megatron-LM's data block through megatron-core's own data code.

Megatron-LM's flags (its names, defaults and meaning): ``--data-path [WEIGHT] PREFIX ...`` (indexed
``PREFIX.bin``/``PREFIX.idx`` files, blended by weight), ``--split 969,30,1``, ``--mock-data``,
``--data-cache-path``, ``--no-mmap-bin-files``, ``--eod-mask-loss``, ``--num-dataset-builder-threads``,
``--tokenizer-type GPT2BPETokenizer|HuggingFaceTokenizer|NullTokenizer`` with ``--vocab-file
--merge-file --tokenizer-model --vocab-size``, ``--make-vocab-size-divisible-by``. The datasets are
megatron-core's ``GPTDataset`` / ``MockGPTDataset`` built by its ``BlendedMegatronDatasetBuilder``, and
samples are dealt as Megatron-LM's ``MegatronPretrainingSampler`` deals them: by the global count of
consumed samples, so the data position resumes exactly after a restart, at any data-parallel size.

megatron-core is optional: it is imported only when a data flag is given.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import pydoc
import warnings
from typing import Any, Optional, Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels with -100 where no loss is taken)
TOKENIZERS = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer")
LEGACY_DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's --split when --data-path comes without one
GPT2_EOD = "<|endoftext|>"


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's data and tokenizer flags that the main job implements."""
    g = parser.add_argument_group("data and tokenizer (Megatron-LM's; megatron-core needed)")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="indexed dataset prefixes (PREFIX.bin/.idx), each optionally preceded by its weight")
    g.add_argument("--split", default=None, help=f"train,valid,test weights (default with --data-path: "
                                                 f"{LEGACY_DEFAULT_SPLIT!r}, as Megatron-LM)")
    g.add_argument("--mock-data", action="store_true", help="megatron-core's MockGPTDataset instead of --data-path")
    g.add_argument("--data-cache-path", default=None, help="where megatron-core caches its dataset indices")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    g.add_argument("--num-workers", type=int, default=2,
                   help="accepted for Megatron-LM's scripts; samples are read in the training process")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="accepted (the model's attention is causal without a mask)")
    g.add_argument("--tokenizer-type", choices=TOKENIZERS, default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this (Megatron-LM's default 128)")


def uses_megatron_data(args: argparse.Namespace) -> bool:
    return bool(args.data_path) or args.mock_data


def check_data_args(args: argparse.Namespace) -> Optional[str]:
    """Megatron-LM's checks of the data flags plus what this script needs; the problem, or None.
    Fills in ``args.split`` (Megatron-LM's legacy default) and ``args.data_split_defaulted``."""
    args.data_split_defaulted = False
    data_given = uses_megatron_data(args)
    if not data_given:
        loose = [flag for flag, value in (("--split", args.split), ("--tokenizer-type", args.tokenizer_type),
                                          ("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file),
                                          ("--tokenizer-model", args.tokenizer_model)) if value is not None]
        if loose:
            return (f"{' '.join(loose)} without --data-path or --mock-data: the built-in corpus has its own "
                    f"characters; give --data-path PREFIX (or --mock-data), or leave them out")
        return None
    if args.data_path is not None and args.mock_data:
        return "--data-path and --mock-data are exclusive: train on indexed files or on megatron-core's mock data"
    if args.data_path is not None and not args.data_path:
        return "--data-path needs at least one dataset prefix (PREFIX for PREFIX.bin and PREFIX.idx)"
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return ("--data-path/--mock-data use megatron-core's data code (megatron.core.datasets), which is not "
                "installed: `pip install megatron-core`, or leave the data flags out to train on the built-in corpus")
    if args.data_path:
        problem = _check_blend(args.data_path)
        if problem:
            return problem
        if args.split is None:
            args.split, args.data_split_defaulted = LEGACY_DEFAULT_SPLIT, True
    elif args.split is None:
        args.split = "99,1,0"  # mock data: a validation split, as Megatron-LM's mock runs evaluate
    for flag, value in (("--num-dataset-builder-threads", args.num_dataset_builder_threads),
                        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)):
        if value <= 0:
            return f"{flag} must be a positive integer, got {value}"
    return _check_tokenizer(args)


def _check_blend(words: list[str]) -> Optional[str]:
    weighted = len(words) > 1 or _is_number(words[0])
    if weighted and (len(words) % 2 or not all(_is_number(w) for w in words[::2])):
        return (f"--data-path {' '.join(words)}: give prefixes alone (PREFIX ...) or weight-prefix pairs "
                f"(W1 PREFIX1 W2 PREFIX2 ...), as Megatron-LM")
    prefixes = words[1::2] if weighted and _is_number(words[0]) else words
    missing = [f"{p}{ext}" for p in prefixes for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
    if missing:
        return (f"--data-path: {', '.join(missing)} not found; --data-path takes the prefix of megatron-core's "
                f"indexed dataset files (PREFIX.bin and PREFIX.idx, as tools/preprocess_data.py writes them)")
    return None


def _check_tokenizer(args: argparse.Namespace) -> Optional[str]:
    kind = args.tokenizer_type
    if kind is None:
        if args.mock_data:
            return "--mock-data needs a tokenizer: --tokenizer-type NullTokenizer --vocab-size N (or another)"
        return "--data-path needs --tokenizer-type (GPT2BPETokenizer with --vocab-file and --merge-file, ...)"
    needs = {"GPT2BPETokenizer": ("vocab_file", "merge_file"), "HuggingFaceTokenizer": ("tokenizer_model",),
             "NullTokenizer": ("vocab_size",)}[kind]
    missing = ["--" + dest.replace("_", "-") for dest in needs if getattr(args, dest) is None]
    if missing:
        return f"--tokenizer-type {kind} needs {' and '.join(missing)}"
    for dest in ("vocab_file", "merge_file"):
        path = getattr(args, dest)
        if dest in needs and not os.path.isfile(path):
            return f"--{dest.replace('_', '-')} {path}: no such file"
    if kind == "HuggingFaceTokenizer" and importlib.util.find_spec("transformers") is None:
        return ("--tokenizer-type HuggingFaceTokenizer loads --tokenizer-model with the transformers package, which "
                "is not installed: `pip install transformers`")
    if kind == "NullTokenizer" and args.vocab_size <= 0:
        return f"--vocab-size must be a positive integer, got {args.vocab_size}"
    return None


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------- tokenizers
class GPT2Vocab:
    """What pretraining from pre-tokenized .bin/.idx files needs of Megatron-LM's GPT2BPETokenizer: its
    vocabulary size (the entries of --vocab-file) and end-of-document id (``<|endoftext|>``). Text is
    never tokenized here (tools/preprocess_data.py did that), so the BPE merges are only checked to exist.
    megatron-core 0.16's own GPT2BPETokenizer needs the transformers package for the same two numbers."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            encoder = json.load(f)
        if not isinstance(encoder, dict) or GPT2_EOD not in encoder:
            raise ValueError(f"--vocab-file {vocab_file}: not a GPT-2 vocabulary (a JSON object of token -> id with "
                             f"{GPT2_EOD!r})")
        self.vocab_size = len(encoder)
        self.eod = int(encoder[GPT2_EOD])
        self.unique_identifiers = {"class": "GPT2BPETokenizer", "vocab_file": os.path.abspath(vocab_file),
                                   "merge_file": os.path.abspath(merge_file)}


def build_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer megatron-core's GPTDatasetConfig takes (vocab_size, eod, unique_identifiers)."""
    if args.tokenizer_type == "GPT2BPETokenizer":
        return GPT2Vocab(args.vocab_file, args.merge_file)
    from megatron.core.tokenizers import MegatronTokenizer

    if args.tokenizer_type == "NullTokenizer":
        from megatron.core.tokenizers import megatron_tokenizer

        # megatron-core 0.16 names the null tokenizer's library "null", 0.19 "null-text"
        library = "null" if "null" in getattr(megatron_tokenizer, "TOKENIZER_LIBRARIES", ()) else "null-text"
        return MegatronTokenizer.from_pretrained(metadata_path={"library": library}, vocab_size=args.vocab_size)
    return MegatronTokenizer.from_pretrained(tokenizer_path=args.tokenizer_model,
                                             metadata_path={"library": "huggingface"})


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Megatron-LM's _vocab_size_with_padding (tensor-parallel size 1)."""
    return int(math.ceil(vocab_size / divisible_by) * divisible_by)


# ----------------------------------------------------------------------------- the sources
class BatchSource(Protocol):
    vocab_size: int
    description: str
    has_valid: bool
    has_test: bool

    def train_batches(self, consumed: int, count: int) -> list[Batch]: ...
    def eval_batches(self, split: str, consumed: int, count: int) -> list[Batch]: ...
    def rank_state(self) -> dict: ...
    def resume(self, rank_state: Optional[dict], start_iteration: int) -> None: ...


STDLIB_MODULES = ("collections", "functools", "itertools", "json", "os", "pathlib", "re", "string",
                  "textwrap", "typing", "argparse", "logging", "dataclasses", "statistics", "heapq")
VALID_FRACTION = 20  # the built-in corpus' last 1/20 is its validation split


def build_corpus() -> str:
    parts = []
    for name in STDLIB_MODULES:
        module = __import__(name)
        parts.append(pydoc.getdoc(module))
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if not attr.startswith("_") and callable(obj):
                parts.append(pydoc.getdoc(obj))
    return "\n\n".join(p for p in parts if p)


class CharSource:
    """The built-in corpus: character-level documents of random length from the docstrings of Python's
    standard library, padded with ignored labels (so micro-batches carry different numbers of
    supervised tokens). Each rank draws its own training stream (rank_state holds its position); the
    validation split is the corpus' last 1/20, its samples fixed by their index."""

    has_test = False
    has_valid = True

    def __init__(self, seq_len: int, micro_batch_size: int, seed: int, rank: int, dp: int) -> None:
        text = build_corpus()
        chars = sorted(set(text))
        self.vocab_size = len(chars) + 1  # 0 pads
        index = {c: i + 1 for i, c in enumerate(chars)}
        data = torch.tensor([index[c] for c in text], dtype=torch.long)
        cut = len(data) - len(data) // VALID_FRACTION
        self.train, self.valid = data[:cut], data[cut:]
        self.seq_len, self.mbs, self.seed, self.rank, self.dp = seq_len, micro_batch_size, seed, rank, dp
        self.gen = torch.Generator().manual_seed(seed + rank)
        self.description = f"built-in corpus ({len(data):,} characters, vocabulary {self.vocab_size})"

    def _documents(self, data: torch.Tensor, gen: torch.Generator, size: int) -> Batch:
        starts = torch.randint(0, len(data) - self.seq_len - 1, (size,), generator=gen)
        lengths = torch.randint(self.seq_len // 4, self.seq_len + 1, (size,), generator=gen)
        tokens = torch.stack([data[s : s + self.seq_len] for s in starts])
        labels = torch.stack([data[s + 1 : s + self.seq_len + 1] for s in starts])
        past_end = torch.arange(self.seq_len)[None, :] >= lengths[:, None]
        return tokens.masked_fill(past_end, 0), labels.masked_fill(past_end, -100)

    def train_batches(self, consumed: int, count: int) -> list[Batch]:
        return [self._documents(self.train, self.gen, self.mbs) for _ in range(count)]

    def eval_batches(self, split: str, consumed: int, count: int) -> list[Batch]:
        out = []
        for m in range(count):  # sample i of the split is fixed by i: the same at any DP size
            first = consumed + m * self.mbs * self.dp + self.rank * self.mbs
            samples = [self._documents(self.valid, torch.Generator().manual_seed(self.seed * 7919 + i), 1)
                       for i in range(first, first + self.mbs)]
            out.append((torch.cat([s[0] for s in samples]), torch.cat([s[1] for s in samples])))
        return out

    def rank_state(self) -> dict:
        return {"data": self.gen.get_state()}

    def resume(self, rank_state: Optional[dict], start_iteration: int) -> None:
        if rank_state is not None and "data" in rank_state:
            self.gen.set_state(rank_state["data"])
        else:  # another DP size: each rank's stream starts afresh, away from the first run's
            self.gen.manual_seed(self.seed + self.rank + 7919 * (start_iteration + 1))


class MegatronSource:
    """megatron-core's GPTDataset (or MockGPTDataset) splits, dealt by consumed samples as Megatron-LM's
    MegatronPretrainingSampler deals them: in a step that starts at ``consumed``, micro-batch m of rank
    r holds samples consumed + m x (micro x DP) + r x micro, ... (so a resume at any DP size continues
    at the same sample)."""

    def __init__(self, args: argparse.Namespace, rank: int, dp: int, num_samples: tuple[int, int, int]) -> None:
        with warnings.catch_warnings():  # megatron-core warns at import that apex/Transformer Engine are absent
            warnings.simplefilter("ignore")
            from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
            from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
            from megatron.core.datasets.utils import get_blend_from_list
        if rank != 0:  # megatron-core's dataset notes, once
            logging.getLogger("megatron.core").setLevel(logging.ERROR)

        tokenizer = build_tokenizer(args)
        config = GPTDatasetConfig(
            random_seed=args.seed, sequence_length=args.seq_length,
            blend=get_blend_from_list(args.data_path) if args.data_path else None, split=args.split,
            num_dataset_builder_threads=args.num_dataset_builder_threads, path_to_cache=args.data_cache_path,
            mmap_bin_files=args.mmap_bin_files, tokenizer=tokenizer, reset_position_ids=False,
            reset_attention_mask=False, eod_mask_loss=args.eod_mask_loss, create_attention_mask=False,
            data_parallel_size=dp)
        cls = MockGPTDataset if args.mock_data else GPTDataset
        self.splits = dict(zip(("train", "valid", "test"),
                               BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config).build()))
        self.has_valid, self.has_test = (self.splits[k] is not None and len(self.splits[k]) > 0
                                         for k in ("valid", "test"))
        self.tokenizer_vocab = tokenizer.vocab_size
        self.vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
        self.mbs, self.rank, self.dp = args.micro_batch_size, rank, dp
        source = ("mock data (megatron-core's MockGPTDataset)" if args.mock_data
                  else f"--data-path {' '.join(args.data_path)}")
        self.description = (f"{source}, split {args.split!r} "
                            f"({', '.join(f'{k} {len(v) if v is not None else 0}' for k, v in self.splits.items())} "
                            f"samples), {args.tokenizer_type} vocabulary {tokenizer.vocab_size} padded to "
                            f"{self.vocab_size}")

    def _batches(self, split: str, consumed: int, count: int) -> list[Batch]:
        dataset = self.splits[split]
        out = []
        for m in range(count):
            first = consumed + m * self.mbs * self.dp + self.rank * self.mbs
            if first + self.mbs > len(dataset):
                raise RuntimeError(f"the {split} split has {len(dataset)} samples and the run needs sample "
                                   f"{first + self.mbs - 1}: megatron-core built it for fewer samples than asked")
            samples = [dataset[i] for i in range(first, first + self.mbs)]
            tokens = torch.stack([s["tokens"] for s in samples])
            labels = torch.stack([s["labels"] for s in samples])
            mask = torch.stack([s["loss_mask"] for s in samples])
            out.append((tokens, labels.masked_fill(mask == 0, -100)))
        return out

    def train_batches(self, consumed: int, count: int) -> list[Batch]:
        return self._batches("train", consumed, count)

    def eval_batches(self, split: str, consumed: int, count: int) -> list[Batch]:
        return self._batches(split, consumed, count)

    def rank_state(self) -> dict:
        return {}  # the position is the run's consumed samples

    def resume(self, rank_state: Optional[dict], start_iteration: int) -> None:
        pass


def num_samples(args: argparse.Namespace) -> tuple[int, int, int]:
    """Megatron-LM's get_train_valid_test_num_samples: train, validation and test sample counts."""
    train = args.train_iters * args.global_batch_size
    if args.eval_iters == 0:
        return train, 0, 0
    eval_points = 1 if args.skip_train else args.train_iters // args.eval_interval + 1
    return (train, eval_points * args.eval_iters * args.global_batch_size, args.eval_iters * args.global_batch_size)


def build_source(args: argparse.Namespace, rank: int, dp: int) -> BatchSource:
    if uses_megatron_data(args):
        return MegatronSource(args, rank, dp, num_samples(args))
    return CharSource(args.seq_length, args.micro_batch_size, args.seed, rank, dp)
