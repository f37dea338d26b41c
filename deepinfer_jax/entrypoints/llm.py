"""The offline API: ``LLM(model=..., **engine_config).generate(prompts, sampling_params)``.

```python
from deepinfer_jax import LLM, SamplingParams
llm = LLM(model="v41-tiny", max_num_seqs=8)
outs = llm.generate(["the cat", [0, 17, 42]], SamplingParams(temperature=0.0, max_tokens=8))
print(outs[0].outputs[0].text, llm.stats.summary_line())
```

Every prompt and its sampling parameters are checked before any device work (by the engine,
``engine/input_checks.py``); a bad one raises ``ValueError`` naming the request index and the
field, and nothing is queued.

``generate`` is safe to interrupt (Ctrl-C, or an exception from the prompts iterable, a
callback, ...): the call's requests are aborted and the next call behaves as on a fresh engine.
Calls from several threads are serialised (each waits for the one running).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from deepinfer_jax.engine import input_checks
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.models.registry import DEFAULT_MODEL
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.sampling.params import SamplingParams


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, mesh=None, model_seed: int = 0, progress: bool = True,
                 compile_cache=None, **engine_config: Any):
        """``model``: a model directory (safetensors or Orbax, with ``tokenizer.json`` for text
        prompts), a shipped model (default: the trained ``v41-small-code``) or a preset name
        (random weights). Keywords are ``EngineConfig`` fields; ``mesh`` a jax Mesh
        (default: ``dp``/``cp`` from the config). ``model_seed``: the random weights of a preset
        or of ``load_format="dummy"`` (drawn on the device; a preset's directory then holds only
        its config and tokenizer, no checkpoint is written).
        ``compile_cache``: JAX's persistent compilation cache, so that a later start loads the
        compiled steps (a directory, ``True`` for ``~/.cache/deepinfer_jax/xla``, ``False``;
        default ``$DEEPINFER_COMPILE_CACHE``, else off; process-wide, see ``compile_cache.py``)."""
        from deepinfer_jax.config import ModelConfig
        from deepinfer_jax.entrypoints import compile_cache as cc
        from deepinfer_jax.models.registry import resolve_model

        ec = EngineConfig.from_kwargs(**engine_config)
        cache_dir = cc.resolve(compile_cache)
        if cache_dir is not None:
            cc.enable(cache_dir)
        self.model_dir = resolve_model(model, seed=model_seed, progress=progress,
                                       weights=ec.load_format != "dummy")
        self.model_config = ModelConfig.from_json(self.model_dir)
        import jax

        self.engine_config = ec = ec.resolve(self.model_config, jax.default_backend())
        self.tokenizer = None
        if os.path.exists(os.path.join(self.model_dir, "tokenizer.json")):
            from deepinfer_jax.tokenizer.loader import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir, bos_token_id=self.model_config.bos_token_id,
                                            eos_token_id=self.model_config.eos_token_id)
        if mesh is None and ec.dp * ec.cp > 1:
            from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh

            mesh = make_mesh(ParallelConfig(dp=ec.dp, cp=ec.cp))
        from deepinfer_jax.engine.llm_engine import LLMEngine
        from deepinfer_jax.runner.model_runner import ModelRunner

        # attention data parallel and balanced context parallelism; a multi-process mesh always
        # takes the DP program (its outputs come back to every process)
        if mesh is None and ec.eplb_redundant_experts:  # redundant experts live in the DP program
            from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh

            mesh = make_mesh(ParallelConfig(), devices=jax.devices()[:1])
        if mesh is not None and (mesh.shape.get("dp", 1) > 1 or mesh.shape.get("cp", 1) > 1
                                 or jax.process_count() > 1 or ec.eplb_redundant_experts):
            from deepinfer_jax.runner.dp_runner import DPModelRunner

            self.runner = DPModelRunner(self.model_dir, ec, cfg=self.model_config, mesh=mesh, progress=progress,
                                        model_seed=model_seed)
        else:
            self.runner = ModelRunner(self.model_dir, ec, cfg=self.model_config, mesh=mesh, progress=progress,
                                      model_seed=model_seed)
        self.compile_time_s = self.runner.warmup(progress) if ec.precompile else 0.0
        tok_json = os.path.join(self.model_dir, "tokenizer.json")
        self.engine = LLMEngine(self.runner, ec, self.tokenizer, self.model_config.eos_token_id,
                                vocab_size=self.model_config.vocab_size,
                                tokenizer_json=tok_json if os.path.exists(tok_json) else None)
        self._next_id = 0
        self._lock = threading.Lock()  # one generate() at a time
        self._unclean = False  # a generate() call ended without its clean-up

    @property
    def stats(self):
        return self.engine.stats

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order."""
        with self._lock:
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if self._unclean:  # a call whose clean-up was itself cut short (a second Ctrl-C)
            self.engine.abort_all()
            self._unclean = False
        if self.engine.has_unfinished_requests():
            raise RuntimeError("generate() called while the engine still has requests")
        prompts = input_checks.as_prompt_list(prompts)
        params = input_checks.params_list(sampling_params, len(prompts))
        ids = [str(self._next_id + i) for i in range(len(prompts))]
        reqs = self.engine.check_requests(list(zip(ids, prompts, params)))
        self._next_id += len(ids)
        self.engine.stats.reset()
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        self._unclean = True
        try:
            self.engine.add_checked(reqs, arrival_time=time.monotonic())
            done = self.engine.run_until_done(on_finish=lambda o: bar.update(1))
        except BaseException:
            self.engine.abort_all()  # frees the call's blocks and slots; the engine stays usable
            raise
        finally:
            bar.close()
        self._unclean = False
        logging.getLogger("deepinfer_jax").info(self.engine.stats.summary_line())
        by_id = {o.request_id: o for o in done}
        return [by_id[r] for r in ids]
