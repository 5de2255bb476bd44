"""The run's data, made ready before the pods configure: the tokenizer (loaded, or a BPE trained
on the corpus and cached), the token cache, the dataset of packed sequences, and the config whose
model.vocab_size follows the tokenizer.

Each piece does its own job (tokenizer.py, sources.py, token_cache.py, dataset.py); this module
only resolves `data.*` into them, in order, and is the one place that decides the vocab size.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import time

from multipod.controller.core.run_config import Config, ConfigError
from multipod.controller.data.cache_store import default_root, mark_used
from multipod.controller.data.dataset import TokenDataset
from multipod.controller.data.sources import iter_documents, source_bytes, source_fingerprint
from multipod.controller.data.token_cache import SPLIT_RULE, held_out, open_cache
from multipod.controller.data.tokenizer import (
    TRAIN_BYTES,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    padded_vocab,
    sampled,
    train_bpe,
)
from multipod.controller.observe.metrics import out

# Bump when the recipe of a "bpe:N" tokenizer changes: cached ones are then retrained. 2: trained
# on the training documents only (the held-out ones left out); 3: on a sample spread over a source
# larger than TRAIN_BYTES, not on its first TRAIN_BYTES (tokenizer.sampled).
TOKENIZER_FORMAT = 3


@dataclasses.dataclass
class RunData:
    """What the controller feeds and reads the model with."""
    config: Config              # model.vocab_size resolved
    tokenizer: Tokenizer
    dataset: TokenDataset


def cache_root(config: Config) -> pathlib.Path:
    """data.cache_dir, else $MULTIPOD_CACHE_DIR, else ~/.cache/multipod."""
    return pathlib.Path(config.data.cache_dir) if config.data.cache_dir else default_root()


def resolve_tokenizer(config: Config, root: pathlib.Path) -> Tokenizer:
    """data.tokenizer as a Tokenizer; "bpe:N" is trained on data.path once and reused from the
    cache while the corpus is unchanged."""
    data = config.data
    size = data.bpe_size()
    if size is None:
        return load_tokenizer(data.tokenizer)
    # The split rule is in the key: it decides which documents the tokenizer may see.
    source = source_fingerprint(data.path, data.text_field, data.max_bytes)
    key = hashlib.blake2b(f"{TOKENIZER_FORMAT}|{size}|{SPLIT_RULE}|{TRAIN_BYTES}|{source}".encode(),
                          digest_size=16).hexdigest()
    path = root / "tokenizers" / key / "tokenizer.json"
    if path.is_file():
        tokenizer = load_tokenizer(str(path))
        mark_used(path.parent)      # what `multipod cache prune` goes by
        out(f"tokenizer: reusing the BPE of {size:,} tokens trained on this corpus ({path})")
        return tokenizer
    out(f"tokenizer: training a byte-level BPE of {size:,} tokens on the corpus (once; cached in {path.parent})")
    started = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    # The held-out documents stay out of the tokenizer's training too. (A source of fewer than
    # token_cache.EVAL_EVERY documents holds out the tail of its tokens instead, which the
    # tokenizer does see.)
    texts = (doc.text for number, doc in enumerate(iter_documents(data.path, data.text_field, max_bytes=data.max_bytes))
             if not held_out(number))
    # At most TRAIN_BYTES of text (seconds), spread over the whole source.
    tokenizer = train_bpe(sampled(texts, source_bytes(data.path, data.max_bytes), {}), size, path)
    out(f"tokenizer: trained in {time.perf_counter() - started:.1f}s")
    return tokenizer


def resolve_vocab(config: Config, tokenizer: Tokenizer, vocab_given: bool) -> Config:
    """config with model.vocab_size = the tokenizer's, padded up to a multiple of 128 (so that it
    shards); a model.vocab_size the user gave is kept if it holds every id, else an error naming
    the tokenizer."""
    needed = tokenizer.vocab_size
    if vocab_given:
        if config.model.vocab_size < needed:
            raise TokenizerError(f"tokenizer {tokenizer.name} has {needed:,} tokens, more than model.vocab_size = "
                                 f"{config.model.vocab_size:,} allows: raise it, or leave it unset to follow the "
                                 f"tokenizer")
        return config
    padded = padded_vocab(needed)
    if padded > needed:
        out(f"model.vocab_size = {padded:,}: the tokenizer's {needed:,} ids padded up to a multiple of 128")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=padded)).validate()


def prepare(config: Config, vocab_given: bool = False, progress: bool = True) -> RunData:
    """The tokenizer, the token cache and the dataset of `config`, and the config with its
    vocabulary resolved. DataError (a TokenizerError among them) naming the file on bad input."""
    root = cache_root(config)
    if config.prompt.enabled:
        return prepare_task(config, root)
    tokenizer = resolve_tokenizer(config, root)
    config = resolve_vocab(config, tokenizer, vocab_given)
    cache = open_cache(config.data.path, tokenizer, root, config.data.text_field, progress=progress,
                       max_bytes=config.data.max_bytes)
    dataset = TokenDataset(cache, config.data.seq_len, config.data.global_batch, config.run.seed)
    return RunData(config=config, tokenizer=tokenizer, dataset=dataset)


def prepare_task(config: Config, root: pathlib.Path) -> RunData:
    """Prompt tuning: the base model's tokenizer (data.tokenizer names its file) and the task's
    examples (task_data.py). The vocabulary is the base model's; it must hold every id."""
    from multipod.controller.data.task import TaskDataset, read_examples
    if config.data.bpe_size() is not None:
        raise ConfigError("data.tokenizer", "prompt tuning uses the base model's tokenizer (its file, or \"bytes\"), "
                          "not a new bpe:N")
    tokenizer = resolve_tokenizer(config, root)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError("data.tokenizer", f"{tokenizer.name} has {tokenizer.vocab_size:,} tokens, more than the base "
                          f"model's vocabulary of {config.model.vocab_size:,}")
    if not config.data.path or pathlib.Path(config.data.path).suffix != ".jsonl":
        raise ConfigError("data.path", f"prompt tuning reads a .jsonl of examples, got {config.data.path!r}")
    examples = read_examples(config.data.path, tokenizer, config.data.input_field, config.data.output_field)
    dataset = TaskDataset(examples, config.data.seq_len, config.data.global_batch, config.run.seed, tokenizer.eos_id)
    return RunData(config=config, tokenizer=tokenizer, dataset=dataset)


# What a checkpoint directory holds beside the step folders, so that a checkpoint can be used
# without the run directory (multipod generate): the resolved config, and the tokenizer's file.
RUN_CONFIG = "run_config.json"
TOKENIZER_FILES = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model"}


def write_beside_checkpoints(data: RunData, directory: str | pathlib.Path) -> bool:
    """Put the run's resolved config and its tokenizer's file (none for bytes) in the checkpoint
    directory, each written whole (a temporary file, then a rename). A directory that cannot be
    written is a warning (False), never the run's failure: the checkpointer reports failed saves
    there at once, and the run goes on."""
    root = pathlib.Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        partial = root / (RUN_CONFIG + ".partial")
        partial.write_text(json.dumps(data.config.to_dict(), indent=2, sort_keys=True) + "\n")
        partial.replace(root / RUN_CONFIG)
        name = TOKENIZER_FILES.get(data.tokenizer.kind)
        if name is not None:
            partial = root / (name + ".partial")
            shutil.copyfile(data.tokenizer.name, partial)
            partial.replace(root / name)
    except OSError as exc:
        out(f"warning: the run's config and tokenizer could not be written beside the checkpoints in {root}: {exc}")
        return False
    return True
