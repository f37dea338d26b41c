"""``EngineConfig``: every knob of the offline engine (scheduler, caches, runner), validated.

Fields follow vLLM's names where one exists. ``resolve(model_cfg)`` fills the model-dependent
defaults (``block_tokens``, ``max_model_len``, ``num_blocks``, ``prefix_replay_tokens``, token
buckets) and checks the combination; errors name the field and the value.
"""

from __future__ import annotations

import dataclasses
import math

YOCO_MODES = ("off", "mask", "compact")
PREFIX_REPLAY_MODES = ("bounded", "exact")
SPEC_DECODE_MODES = ("off", "dspark")
SPEC_RULES = ("uniform", "coupled")
# where the weights come from (vLLM's names): "auto" the model directory's checkpoint; "dummy"
# drawn at random on the device (models/random_weights.py), only config.json and tokenizer.json read
LOAD_FORMATS = ("auto", "dummy")
# DeepInfer's switches, accepted as keyword aliases and read from the environment when the field
# is left at None: DEEPINFER_USE_NEXTN_DECODE=1 -> spec_decode="dspark",
# DEEPINFER_ENABLE_MTP_VARLEN=0/1 -> spec_varlen
SPEC_ALIASES = {"DEEPINFER_USE_NEXTN_DECODE": "spec_decode", "DEEPINFER_ENABLE_MTP_VARLEN": "spec_varlen"}
# DEEPINFER_BATCH_INVARIANT=0/1 -> batch_invariant (keyword alias, and the default when the field is None)
BATCH_INVARIANT_ALIAS = "DEEPINFER_BATCH_INVARIANT"


def _env_flag(name: str, raw) -> bool:
    v = str(raw).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0/1 (or true/false)")


def exact_replay_tokens(cfg) -> int:
    """Replayed tokens that rebuild the sliding-window state exactly: (n_layers-1)*(W-1)+W."""
    W = cfg.sliding_window
    return (cfg.num_hidden_layers - 1) * (W - 1) + W

# field -> (kind, lowest value or None, None allowed); kinds: "int", "num", "bool", "str", "ints" (a
# non-empty tuple or list of ints). Ranges that need the model (max_model_len, max_logprobs) are
# checked in resolve. block_tokens and prefix_replay_tokens are type-checked only here.
_FIELD_TYPES = {
    "max_num_seqs": ("int", 1, False), "max_num_batched_tokens": ("int", 1, False),
    "max_model_len": ("int", None, True), "block_tokens": ("int", None, True),
    "num_blocks": ("int", 1, True), "enable_prefix_caching": ("bool", None, False),
    "index_key_dtype": ("str", None, False), "kv_cache_dtype": ("str", None, False), "prefix_replay": ("str", None, False),
    "prefix_replay_tokens": ("int", None, True),
    "yoco_truncation": ("str", None, False), "yoco_keep_tokens": ("int", 0, False),
    "max_backtracking_tokens": ("int", 0, False), "async_scheduling": ("bool", None, False),
    "dispatch_thread": ("bool", None, True),
    "token_buckets": ("ints", 1, True), "row_buckets": ("ints", 1, True), "decoder_buckets": ("ints", 1, True),
    "max_logprobs": ("int", 0, False), "seed": ("int", 0, False), "kernels": ("str", None, True),
    "dp": ("int", 1, False), "cp": ("int", 1, False), "cp_min_tokens": ("int", 1, True),
    "ep_scheme": ("str", None, False),
    "eplb_redundant_experts": ("int", 0, False), "eplb_window": ("int", 1, False), "eplb_interval": ("int", 0, False),
    "precompile": ("bool", None, False), "compile_workers": ("int", 1, True),
    "spec_decode": ("str", None, True), "num_draft_tokens": ("int", 1, True), "spec_varlen": ("bool", None, True),
    "spec_rule": ("str", None, False), "spec_force_accept": ("num", None, True),
    "spec_calibration": ("bool", None, False), "spec_plain_steps": ("bool", None, True),
    "batch_invariant": ("bool", None, True), "load_format": ("str", None, False),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # Python ints: they become static shapes


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # --- scheduler ---
    max_num_seqs: int = 16                 # running requests (one sliding-window slot each)
    max_num_batched_tokens: int = 256      # token budget of one step (prefill chunks + decode)
    max_model_len: int | None = None       # default: min(max_position_embeddings, 4096)
    # --- caches ---
    # positions per paged block; default (None): the size nearest 64 that the model's compress
    # ratios and candidate blocks divide (models/cache.py: default_block_tokens)
    block_tokens: int | None = None
    num_blocks: int | None = None          # default: max_num_seqs full-length sequences
    enable_prefix_caching: bool = True
    index_key_dtype: str = "bf16"          # index-key cache: "bf16" or "fp8" (same results, 52% of the bytes)
    kv_cache_dtype: str = "bf16"           # window + compressed KV: "bf16" or "packed" (same results, 52% / 28%)
    # a prefix-cache hit rebuilds the sliding-window state by replaying the tail of the cached
    # prefix (host_scheduler/scheduler.py): "bounded" replays prefix_replay_tokens (default
    # yoco_keep_tokens), DeepSeek's approximation; "exact" replays (n_layers-1)*(W-1)+W, the
    # window chain's receptive field (5081 for V4.1-Flash: more than a 4096 max_model_len holds)
    prefix_replay: str = "bounded"
    prefix_replay_tokens: int | None = None
    # --- YOCO prefill truncation (FEATURES §5) ---
    yoco_truncation: str = "compact"
    yoco_keep_tokens: int = 140
    max_backtracking_tokens: int = 12      # positions the window state may be rolled back by
    # --- runner ---
    async_scheduling: bool = True
    # the jitted call of each step runs on a runner thread (runner/step_launcher.py): the call's
    # own host time (argument handling, the launch of the step's kernels) overlaps the engine's
    # planning and result processing instead of adding to them. Tokens are the same either way.
    # None: on where the step runs on an accelerator (the launch is worth overlapping), off on CPU
    dispatch_thread: bool | None = None
    # padded step sizes; default: powers of 2 from 16 up to max_num_batched_tokens, or on CPU
    # (where compiling dominates) the single size max_num_batched_tokens
    token_buckets: tuple[int, ...] | None = None
    # padded request counts per step (sampler rows); default: max_num_seqs alone. More sizes cut
    # the sampler's per-row work for small batches at the price of more compiled variants
    row_buckets: tuple[int, ...] | None = None
    # compact YOCO truncation: padded decoder-token counts (each <= the step's token bucket);
    # default: the token buckets. Compiled variants grow with (token, decoder) bucket pairs
    decoder_buckets: tuple[int, ...] | None = None
    max_logprobs: int = 20
    seed: int = 0                          # seeds requests that give no seed of their own
    kernels: str | None = None             # "auto" | "reference" | "ffi"; None: $DEEPINFER_KERNELS or "auto"
    # the mesh (sharding/mesh.py). dp > 1: attention data parallel, each rank its own requests and
    # cache (runner/dp_runner.py); max_num_seqs, num_blocks and max_num_batched_tokens are then
    # per rank. The experts are split over dp x cp. cp > 1: balanced context parallelism, a
    # rank's long steps split over its cp devices (sharding/context_parallel.py)
    dp: int = 1
    cp: int = 1
    # cp > 1: a step whose per-rank token bucket holds at least this many tokens (and divides
    # over cp) splits them over the rank's cp devices, long prompt chunks in the mirror layout
    # (base/cp_layout.py); smaller steps (decode) run every token's attention on each cp device.
    # None: never split
    cp_min_tokens: int | None = 512
    # attention DP: how tokens reach their experts (kernels_pallas/moe_ep.py): "a2a" (each
    # (token, slot) to the device owning its expert, ragged all-to-all) or "psum" (all tokens to
    # every device, an exact sum back); the outputs are bit-identical
    ep_scheme: str = "a2a"
    # EPLB (sharding/eplb.py, runner/dp_runner.py): physical expert slots per MoE layer beyond the
    # logical experts (0: off; E + this must divide over the devices), the window of per-step
    # slot loads, and the steps between rebalances (0: only LLM.runner.rebalance()); DeepSeek's
    # decode: one redundant expert per GPU, window 1000, every 10000 steps
    eplb_redundant_experts: int = 0
    eplb_window: int = 1000
    eplb_interval: int = 10000
    precompile: bool = True                # compile every bucket at start-up
    # threads XLA compiles the step variants on at start-up (after tracing and lowering them one
    # by one); None: half this host's cores; 1: one variant after another
    compile_workers: int | None = None
    # a request's logits (and, with its seed, its tokens) do not depend on the other requests of
    # its steps, the padded step size or its prompt's chunking (base/batch_invariant.py; costs
    # throughput, scripts/bench_batch_invariance.py). None: $DEEPINFER_BATCH_INVARIANT, else False
    batch_invariant: bool | None = None
    # "auto": the weights of the model directory; "dummy": random weights drawn on the device from
    # LLM's model_seed (models/random_weights.py; seconds, where a multi-GB random checkpoint
    # takes minutes through the host), the directory supplying only config.json and
    # tokenizer.json: throughput benchmarks of model shapes without released weights
    load_format: str = "auto"
    # --- speculative decoding (FEATURES §4) ---
    # "dspark": the model's DSpark stages draft a block after every step and the next step
    # verifies it; None: $DEEPINFER_USE_NEXTN_DECODE (1 -> "dspark"), else "off"
    spec_decode: str | None = None
    num_draft_tokens: int | None = None    # drafts a verification row carries at most; default the model's block
    # confidence-scheduled variable-length verification (Algorithm 1); False: always the full
    # num_draft_tokens. None: $DEEPINFER_ENABLE_MTP_VARLEN, else True
    spec_varlen: bool | None = None
    spec_rule: str = "uniform"             # rejection rule of sampled rows (sampling/spec_verify.py)
    # benchmarks only: accept each draft with this probability whatever the target says (the
    # output is not the model's; runner/spec_step.py forced_verification). None: off
    spec_force_accept: float | None = None
    # varlen only: per-draft-position temperatures fitted online to the observed acceptance
    # (the paper's STS, host_scheduler/spec_calibration.py) rescale the confidences Algorithm 1
    # ranks; the drafts and the output are unchanged, only the verification lengths
    spec_calibration: bool = False
    # varlen only: when verifying drafts does not pay for itself (a large batch, a low
    # acceptance), run steps without speculation at all: one row token, no drafting, no
    # rollback (host_scheduler/spec_switch.py). Compiles a second set of step variants. None:
    # on with spec_varlen on one attention-DP rank (dp=1), else off
    spec_plain_steps: bool | None = None

    def _bad(self, field: str, why: str):
        raise ValueError(f"EngineConfig.{field}={getattr(self, field)!r}: {why}")

    def _check_types(self, cfg) -> None:
        """Every field's type (bools are not ints here, and ints not bools) and lower bound;
        ``max_logprobs`` at most the vocabulary size."""
        for f, (kind, lo, optional) in _FIELD_TYPES.items():
            v = getattr(self, f)
            if v is None and optional:
                continue
            if kind == "bool":
                if not isinstance(v, bool):
                    self._bad(f, "must be a bool (True or False)" + (" or None" if optional else ""))
            elif kind == "str":
                if not isinstance(v, str):
                    self._bad(f, "must be a string" + (" or None" if optional else ""))
            elif kind == "num":
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    self._bad(f, "must be a number" + (" or None" if optional else ""))
            elif kind == "int":
                if not _is_int(v):
                    self._bad(f, "must be an int" + (" or None" if optional else ""))
                if lo is not None and v < lo:
                    self._bad(f, f"must be >= {lo}")
            elif not isinstance(v, (tuple, list)) or not v or not all(_is_int(b) and b >= lo for b in v):
                self._bad(f, f"must be a non-empty tuple of ints >= {lo} (or None for the default)")
        if self.max_logprobs > cfg.vocab_size:
            self._bad("max_logprobs", f"must be <= the model's vocab_size ({cfg.vocab_size})")

    def resolve(self, cfg, platform: str | None = None) -> "EngineConfig":
        """Defaults that depend on the model (and the platform: ``jax.default_backend()``), then
        the checks. Returns a new config."""
        self._check_types(cfg)
        for f in ("max_num_seqs", "max_num_batched_tokens", "dp", "cp"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                self._bad(f, "must be an integer >= 1")
        if self.yoco_truncation not in YOCO_MODES:
            self._bad("yoco_truncation", f"expected one of {YOCO_MODES}")
        if self.load_format not in LOAD_FORMATS:
            self._bad("load_format", f"expected one of {LOAD_FORMATS}")
        if self.ep_scheme not in ("a2a", "psum"):
            self._bad("ep_scheme", "expected 'a2a' or 'psum'")
        if self.kernels not in (None, "auto", "reference", "ffi"):
            self._bad("kernels", "expected 'auto', 'reference' or 'ffi'")
        from deepinfer_jax.base.quant import INDEX_KEY_DTYPES

        if self.index_key_dtype not in INDEX_KEY_DTYPES:
            self._bad("index_key_dtype", f"expected one of {INDEX_KEY_DTYPES}")
        from deepinfer_jax.base.kv_codes import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            self._bad("kv_cache_dtype", f"expected one of {KV_CACHE_DTYPES}")
        if self.max_logprobs < 0:
            self._bad("max_logprobs", "must be >= 0")
        if self.seed < 0:
            self._bad("seed", "must be >= 0")
        W = cfg.sliding_window
        if self.yoco_truncation != "off" and self.yoco_keep_tokens < W + self.max_backtracking_tokens:
            self._bad("yoco_keep_tokens", f"must be >= sliding_window ({W}) + max_backtracking_tokens "
                                          f"({self.max_backtracking_tokens}) = {W + self.max_backtracking_tokens}")
        bt = self._resolve_block_tokens(cfg)
        max_len = self.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_len < 2 or max_len > cfg.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len={max_len}: must be in "
                             f"[2, max_position_embeddings={cfg.max_position_embeddings}]")
        max_len = -(-max_len // bt) * bt if self.max_model_len is None else max_len
        max_len = min(max_len, cfg.max_position_embeddings)
        blocks_per_seq = -(-max_len // bt)
        num_blocks = self.num_blocks if self.num_blocks is not None else self.max_num_seqs * blocks_per_seq
        if num_blocks < blocks_per_seq:
            raise ValueError(f"EngineConfig.num_blocks={num_blocks}: fewer than one max_model_len sequence "
                             f"needs ({blocks_per_seq} blocks of {bt} tokens)")
        replay, caching = self._replay_tokens(cfg, max_len, bt)
        buckets = self.token_buckets
        if buckets is None and platform == "cpu":
            buckets = (self.max_num_batched_tokens,)
        if buckets is None:
            b, buckets = 16, []
            while b < self.max_num_batched_tokens:
                buckets.append(b)
                b *= 2
            buckets.append(self.max_num_batched_tokens)
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            self._bad("token_buckets", "needs at least one size >= 1")
        if buckets[-1] < self.max_num_batched_tokens:
            self._bad("token_buckets", f"largest bucket < max_num_batched_tokens={self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            self._bad("max_num_batched_tokens", f"must be >= max_num_seqs={self.max_num_seqs} "
                                                "(every running request decodes one token per step)")
        rows = tuple(sorted(set(int(b) for b in (self.row_buckets or (self.max_num_seqs,)))))
        if rows[0] < 1 or rows[-1] != self.max_num_seqs:
            self._bad("row_buckets", f"sizes must be >= 1 and the largest must be max_num_seqs={self.max_num_seqs}")
        dec = tuple(sorted(set(int(b) for b in (self.decoder_buckets or buckets))))
        if dec[0] < 1:
            self._bad("decoder_buckets", "sizes must be >= 1")
        spec, n_draft, varlen = self._resolve_spec(cfg)
        plain = self._resolve_plain_steps(spec, varlen)
        inv = self.batch_invariant
        if inv is None:
            import os

            env = os.environ.get(BATCH_INVARIANT_ALIAS)
            inv = env is not None and _env_flag(BATCH_INVARIANT_ALIAS, env)
        thread = self.dispatch_thread if self.dispatch_thread is not None else platform not in (None, "cpu")
        return dataclasses.replace(self, batch_invariant=inv, dispatch_thread=thread, block_tokens=bt, max_model_len=max_len, num_blocks=num_blocks,
                                   enable_prefix_caching=caching,
                                   prefix_replay_tokens=replay, token_buckets=buckets, row_buckets=rows,
                                   decoder_buckets=dec, spec_decode=spec, num_draft_tokens=n_draft,
                                   spec_varlen=varlen, spec_plain_steps=plain)

    def _resolve_plain_steps(self, spec: str, varlen: bool) -> bool:
        plain = self.spec_plain_steps
        if plain is None:
            return spec == "dspark" and varlen and self.dp == 1
        if plain and (spec == "off" or not varlen):
            self._bad("spec_plain_steps", "chooses between verification and plain steps for varlen verification: "
                                          "needs spec_decode='dspark' and spec_varlen=True")
        if plain and self.dp > 1:
            self._bad("spec_plain_steps", f"every attention-DP rank runs the same step program: not with dp={self.dp} "
                                          "(each rank plans its own drafts)")
        return plain

    def _resolve_spec(self, cfg) -> tuple[str, int, bool]:
        import os

        spec = self.spec_decode
        if spec is None:
            env = os.environ.get("DEEPINFER_USE_NEXTN_DECODE")
            spec = "dspark" if env is not None and _env_flag("DEEPINFER_USE_NEXTN_DECODE", env) else "off"
        if spec not in SPEC_DECODE_MODES:
            self._bad("spec_decode", f"expected one of {SPEC_DECODE_MODES} (or None)")
        if self.spec_rule not in SPEC_RULES:
            self._bad("spec_rule", f"expected one of {SPEC_RULES}")
        fa = self.spec_force_accept
        if fa is not None and (isinstance(fa, bool) or not isinstance(fa, (int, float)) or not 0 < fa <= 1):
            self._bad("spec_force_accept", "must be a number in (0, 1] or None")
        varlen = self.spec_varlen
        if varlen is None:
            env = os.environ.get("DEEPINFER_ENABLE_MTP_VARLEN")
            varlen = True if env is None else _env_flag("DEEPINFER_ENABLE_MTP_VARLEN", env)
        if self.spec_calibration and (spec == "off" or not varlen):
            self._bad("spec_calibration", "calibrates the confidences of varlen verification: needs "
                                          "spec_decode='dspark' and spec_varlen=True")
        if spec == "off":
            return spec, self.num_draft_tokens, varlen
        if not cfg.dspark_enabled:
            self._bad("spec_decode", "the model has no DSpark stages (num_nextn_predict_layers=0 or dspark_block_size=0)")
        blk = cfg.dspark_block_size
        n = self.num_draft_tokens if self.num_draft_tokens is not None else blk
        if n > blk:
            self._bad("num_draft_tokens", f"must be <= the model's dspark_block_size ({blk})")
        if n > self.max_backtracking_tokens:
            self._bad("max_backtracking_tokens", f"must be >= num_draft_tokens ({n}): a rejection rolls back that many positions")
        if n + 1 > cfg.sliding_window:
            self._bad("num_draft_tokens", f"a verification row (num_draft_tokens + 1 = {n + 1}) must fit the "
                                          f"sliding window ({cfg.sliding_window})")
        return spec, n, varlen

    def _replay_tokens(self, cfg, max_len: int, bt: int) -> tuple[int, bool]:
        """(the resolved replay tail, whether prefix caching stays on). A setting the user gave
        under which no prefix hit can save work is an error; when only the defaults lead there
        (a short max_model_len), prefix caching is turned off instead, with a log line."""
        if self.prefix_replay not in PREFIX_REPLAY_MODES:
            self._bad("prefix_replay", f"expected one of {PREFIX_REPLAY_MODES}")
        replay, exact = self.prefix_replay_tokens, exact_replay_tokens(cfg)
        if replay is not None and (not isinstance(replay, int) or replay < 0):
            self._bad("prefix_replay_tokens", "must be an integer >= 0 or None")
        if self.prefix_replay == "exact":
            if replay is not None and replay < exact:
                self._bad("prefix_replay_tokens", f"below the exact replay (num_hidden_layers-1)*(sliding_window-1)"
                                                  f"+sliding_window = {exact} of prefix_replay='exact'")
            replay = exact if replay is None else replay
        defaulted = self.prefix_replay == "bounded" and replay is None
        if defaulted:
            replay = self.yoco_keep_tokens
        # the longest hit: full blocks of max_len-1 known tokens less the last one (never a hit);
        # the replay starts at (hit - replay) rounded down to a block
        longest = (max_len - 2) // bt * bt
        if self.enable_prefix_caching and (longest - replay) // bt < 1:
            if defaulted:
                import logging

                logging.getLogger("deepinfer_jax").info(
                    "prefix caching off: with the default replay tail (%d tokens) no prefix hit can save "
                    "work at max_model_len=%d, block_tokens=%d", replay, max_len, bt)
                return replay, False
            raise ValueError(
                f"EngineConfig.prefix_replay={self.prefix_replay!r} with prefix_replay_tokens={replay}"
                f"{' (the exact bound)' if self.prefix_replay == 'exact' else ''}: every "
                f"prefix hit would replay from position 0 (longest hit {longest} tokens at max_model_len="
                f"{max_len}, block_tokens={bt}), so prefix caching saves no work; use prefix_replay='bounded' "
                "with a shorter prefix_replay_tokens, or enable_prefix_caching=False")
        return replay, self.enable_prefix_caching

    def _resolve_block_tokens(self, cfg) -> int:
        """The given block size, checked against the model, or the model's default."""
        from deepinfer_jax.base.block_size import block_tokens_problem, default_block_tokens

        if self.block_tokens is None:
            return default_block_tokens(cfg)
        if not isinstance(self.block_tokens, int) or self.block_tokens < 1:
            self._bad("block_tokens", "must be an integer >= 1 (or None: derived from the model)")
        problem = block_tokens_problem(cfg, self.block_tokens)
        if problem:
            self._bad("block_tokens", problem)
        return self.block_tokens

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_tokens)

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        for alias, field in SPEC_ALIASES.items():
            if alias in kw:
                if field in kw:
                    raise ValueError(f"engine config: both {alias} and its field {field} given")
                on = _env_flag(alias, kw.pop(alias))
                kw[field] = ("dspark" if on else "off") if field == "spec_decode" else on
        if BATCH_INVARIANT_ALIAS in kw:
            if "batch_invariant" in kw:
                raise ValueError(f"engine config: both {BATCH_INVARIANT_ALIAS} and its field batch_invariant given")
            kw["batch_invariant"] = _env_flag(BATCH_INVARIANT_ALIAS, kw.pop(BATCH_INVARIANT_ALIAS))
        unknown = sorted(set(kw) - names)
        if unknown:
            raise ValueError(f"unknown engine config field(s) {unknown}; known: {sorted(names)}")
        return cls(**kw)
