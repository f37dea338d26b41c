"""The offline API: ``LLM(model=..., **engine_config).generate(prompts, sampling_params)``.

```python
from deepinfer_jax import LLM, SamplingParams
llm = LLM(model="v41-tiny", max_num_seqs=8)
outs = llm.generate(["the cat", [0, 17, 42]], SamplingParams(temperature=0.0, max_tokens=8))
print(outs[0].outputs[0].text, llm.stats.summary_line())
```

Every prompt and its sampling parameters are checked before any device work; a bad one raises
``ValueError`` naming the request index and the field, and nothing is queued.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.sampling.params import SamplingParams


class LLM:
    def __init__(self, model: str = "v41-tiny", *, mesh=None, model_seed: int = 0, progress: bool = True,
                 **engine_config: Any):
        """``model``: a model directory (safetensors or Orbax, with ``tokenizer.json`` for text
        prompts) or a preset name. Keywords are ``EngineConfig`` fields; ``mesh`` a jax Mesh
        (default: ``dp``/``cp`` from the config). ``model_seed``: the random weights of a preset."""
        from deepinfer_jax.config import ModelConfig
        from deepinfer_jax.models.registry import resolve_model

        ec = EngineConfig.from_kwargs(**engine_config)
        self.model_dir = resolve_model(model, seed=model_seed, progress=progress)
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

        self.runner = ModelRunner(self.model_dir, ec, cfg=self.model_config, mesh=mesh, progress=progress)
        self.compile_time_s = self.runner.warmup(progress) if ec.precompile else 0.0
        self.engine = LLMEngine(self.runner, ec, self.tokenizer, self.model_config.eos_token_id)
        self._next_id = 0

    @property
    def stats(self):
        return self.engine.stats

    # ------------------------------------------------------------------ input checks
    def _prompt_ids(self, i: int, prompt) -> tuple[list[int], str | None]:
        text = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"request {i}: unknown prompt field(s) {sorted(unknown)}; "
                                 "expected 'prompt' or 'prompt_token_ids'")
            if "prompt_token_ids" in prompt:
                prompt, text = prompt["prompt_token_ids"], prompt.get("prompt")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"request {i}: prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {i}: text prompt but {self.model_dir} has no tokenizer.json; "
                                 "pass prompt_token_ids")
            text = prompt
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            ids = list(prompt)
            if any(isinstance(t, bool) or not isinstance(t, (int,)) and not hasattr(t, "__index__") for t in ids):
                raise ValueError(f"request {i}: prompt_token_ids must be integers")
            ids = [int(t) for t in ids]
        else:
            raise ValueError(f"request {i}: prompt of type {type(prompt).__name__}; expected str, list of "
                             "token ids or a dict with 'prompt_token_ids'")
        if not ids:
            raise ValueError(f"request {i}: prompt is empty")
        V = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"request {i}: prompt_token_ids {bad[:5]} outside the vocabulary [0, {V})")
        L = self.engine_config.max_model_len
        if len(ids) >= L:
            raise ValueError(f"request {i}: prompt has {len(ids)} tokens; max_model_len={L} leaves no room "
                             "for an output token")
        return ids, text

    def _validate(self, prompts, sampling_params) -> list[tuple[list[int], str | None, SamplingParams]]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        out = []
        for i, (pr, sp) in enumerate(zip(prompts, params)):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"request {i}: sampling params of type {type(sp).__name__}")
            sp.validate(i, max_logprobs=self.engine_config.max_logprobs, vocab_size=self.model_config.vocab_size)
            ids, text = self._prompt_ids(i, pr)
            out.append((ids, text, sp))
        return out

    # ------------------------------------------------------------------ generate
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in input order."""
        reqs = self._validate(prompts, sampling_params)
        if self.engine.has_unfinished_requests():
            raise RuntimeError("generate() called while the engine still has requests")
        self.engine.stats.reset()
        ids = []
        now = time.monotonic()
        for prompt_ids, text, sp in reqs:
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, prompt_ids, sp, prompt=text, arrival_time=now)
            ids.append(rid)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        try:
            done = self.engine.run_until_done(on_finish=lambda o: bar.update(1))
        finally:
            bar.close()
        logging.getLogger("deepinfer_jax").info(self.engine.stats.summary_line())
        by_id = {o.request_id: o for o in done}
        return [by_id[r] for r in ids]
