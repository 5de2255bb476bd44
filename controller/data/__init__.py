"""The run's tokens, from source files to per-pod shards; the controller alone sees text.

  sources      documents from text files, directories, .jsonl and .parquet
  tokenizer    text <-> token ids: bytes, a trained BPE, tokenizer.json, SentencePiece
  token_cache  a source tokenized once, then memory-mapped
  cache_store  what the cache holds, and pruning what no run used for a while (`multipod cache`)
  dataset      packed sequences from a token cache, a fresh permutation every epoch
  task         a prompt-tuning task: input/output examples as tokens with a loss mask
  corpus       all of the above made ready before the pods configure
  batches      DataError, the token wire dtype, shards per pod, and the Prefetcher
"""
