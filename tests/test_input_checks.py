"""Request input checks in the engine (``engine/input_checks.py``): every entry point, not only
``LLM.generate``, refuses bad prompts and sampling parameters with a ``ValueError`` naming the
request, and queues nothing of a batch with a bad request. No device: the engine's runner is a
stub (checks happen before anything is dispatched)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from deepinfer_jax.config import preset
from deepinfer_jax.engine import input_checks
from deepinfer_jax.engine.llm_engine import LLMEngine
from deepinfer_jax.engine_config import EngineConfig
from deepinfer_jax.sampling.params import SamplingParams

CFG = preset("v41-tiny")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_tokenizer
    from deepinfer_jax.tokenizer.loader import load_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_random_tokenizer(CFG, d)
    return load_tokenizer(d, bos_token_id=CFG.bos_token_id, eos_token_id=CFG.eos_token_id)


@pytest.fixture()
def engine(tokenizer):
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, precompile=False).resolve(CFG)
    return LLMEngine(types.SimpleNamespace(cfg=CFG), ec, tokenizer, CFG.eos_token_id)


def assert_empty(engine):
    assert not engine.has_unfinished_requests() and not engine.scheduler.requests and not engine._groups


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": "abc"}, r"request 1: prompt_token_ids of type str; expected a sequence of integer"),
    ({"prompt": "a b c", "prompt_token_ids": [3, 4, 6]}, r"request 1: 'prompt' and 'prompt_token_ids' disagree"),
    ({"prompt": [3, 4]}, r"request 1: prompt dict field 'prompt' of type list; expected str"),
    ("a \ud800 b", r"request 1: prompt is not valid Unicode text \(surrogates not allowed at character 2\)"),
    ([5, True], r"request 1: prompt_token_ids\[1\]=True: token ids must be integers"),
    (np.array([True, False]), r"request 1: prompt_token_ids array of shape \(2,\) and dtype bool"),
    (np.array([[5, 6]]), r"request 1: prompt_token_ids array of shape \(1, 2\)"),
    ([5, 2.0], r"request 1: prompt_token_ids\[1\]=2.0: token ids must be integers"),
    (b"abc", r"request 1: prompt of type bytes"),
    ([5, 256], r"request 1: prompt_token_ids \[256\] outside the vocabulary \[0, 256\)"),
    ([5] * 256, r"request 1: prompt has 256 tokens; max_model_len=256"),
])
def test_bad_prompt_refused_and_nothing_queued(engine, prompt, match):
    batch = [("a", [5, 6, 7], GREEDY), ("b", prompt, GREEDY), ("c", "a b c", GREEDY)]
    with pytest.raises(ValueError, match=match):
        engine.add_requests(batch)
    assert_empty(engine)


@pytest.mark.parametrize("params, match", [
    (SamplingParams(top_p=0.0), r"request 2: SamplingParams.top_p=0.0: must be in \(0, 1\]"),
    (SamplingParams(stop_token_ids=[300]), r"request 2: SamplingParams.stop_token_ids=\[300\]: token id 300 out"),
    (SamplingParams(logprobs=21), r"request 2: SamplingParams.logprobs=21: must be in \[0, 20\]"),
    ({"temperature": 0.0}, r"request 2: sampling params of type dict; expected SamplingParams"),
])
def test_bad_sampling_params_refused(engine, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_requests([("a", [5], GREEDY), ("b", [6], GREEDY), ("c", [7], params)])
    assert_empty(engine)


def test_add_request_checks_and_names_the_request_id(engine, tokenizer):
    with pytest.raises(ValueError, match=r"request 'x': prompt_token_ids\[0\]='7': token ids must be integers"):
        engine.add_request("x", ["7"], GREEDY)
    with pytest.raises(ValueError, match=r"request 'x': SamplingParams.max_tokens=0"):
        engine.add_request("x", [7], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"request 'x': 'prompt' and 'prompt_token_ids' disagree"):
        engine.add_request("x", [7, 8], GREEDY, prompt="a b c")
    with pytest.raises(ValueError, match=r"request 7: request id 7 of type int; expected str"):
        engine.add_request(7, [7], GREEDY)
    assert_empty(engine)
    engine.add_request("x", None, GREEDY, prompt="a b c")  # text only: tokenized here
    engine.add_request("y", tokenizer.encode("a b c"), GREEDY, prompt="a b c")  # both, agreeing
    engine.add_request("z", np.array([3, 4, 5], np.int32), GREEDY)
    reqs = engine.scheduler.requests
    assert [reqs[r].prompt_token_ids for r in "xyz"] == [tokenizer.encode("a b c")] * 2 + [[3, 4, 5]]
    assert all(type(t) is int for t in reqs["z"].prompt_token_ids)
    assert engine._prompts == {"x": "a b c", "y": "a b c", "z": None}
    with pytest.raises(ValueError, match=r"request 'y': request id 'y' is already in use"):
        engine.add_request("y", [5], GREEDY)
    with pytest.raises(ValueError, match=r"request 1: request id 'q' is already in use"):
        engine.add_requests([("q", [5], GREEDY), ("q", [6], GREEDY)])
    assert set(engine.scheduler.requests) == {"x", "y", "z"}


def test_prompt_list_forms():
    one = np.array([5, 6, 7])
    assert len(input_checks.as_prompt_list(one)) == 1
    assert len(input_checks.as_prompt_list(np.array([[5, 6], [7, 8], [9, 10]]))) == 3
    assert input_checks.as_prompt_list([np.int64(5), 6]) == [[np.int64(5), 6]]
    assert input_checks.as_prompt_list([[5], "a"]) == [[5], "a"]
    assert input_checks.as_prompt_list(x for x in ("a", "b")) == ["a", "b"]
    assert input_checks.parse_prompt(0, [np.int64(5), np.uint8(6)], None) == ([5, 6], None)
    for bad, shown in [(None, "None"), (5, "5"), (1.5, "1.5"), (True, "True"), (b"ab", "b'ab'")]:
        with pytest.raises(ValueError, match=rf"prompts={shown}: expected a prompt"):
            input_checks.as_prompt_list(bad)
    with pytest.raises(ValueError, match=r"prompts: a 3-D array"):
        input_checks.as_prompt_list(np.zeros((1, 1, 1), np.int32))
