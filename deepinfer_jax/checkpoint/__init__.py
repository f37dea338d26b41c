"""Checkpoint I/O: the official DeepSeek-V4.1 tensor spec and its checks, the safetensors reader
and writer, the fp8/fp4 + ue8m0 storage formats, the non-finite weight check, seeded random
checkpoints, and Orbax state directories. Plain data in and out (numpy arrays, NNX state
pytrees): building the model from a checkpoint is ``models/weights.py``'s job."""
