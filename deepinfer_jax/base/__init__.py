"""The lowest room: data formats every other room may use and that imports no other room:
quantization numerics (``quant.py``: fp8/fp4 QDQ, index-key codes) and the ragged batch layout of
a step (``forward_batch.py``) and the plan of a step the scheduler hands the runner
(``scheduler_output.py``). Importing ``base`` alone imports no JAX."""
