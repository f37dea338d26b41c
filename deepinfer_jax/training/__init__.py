"""Training of V4.1-architecture models: the training forward (the inference prefill step on a
fresh cache), next-token loss, the AdamW loop with fp32 master weights, resumable state, and the
export of trained weights as an official-format checkpoint; the corpus preparation (corpus.py:
source files, split, byte-level BPE tokenizer, token files, compression baselines). Engram layers
take their hash ids from the caller (the runner's host hasher, which training does not import).
Imports models, checkpoint, layers, base and config; nothing imports it."""
