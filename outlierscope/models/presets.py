"""Named presets of matched Transformer / Diff Transformer pairs.

One frozen dataclass holds the numbers of a pair; both Hugging Face configs are built
from it, so the two models differ in the attention class (and its 4 lambda vectors per
layer) only. This is the matched setting of the Diff Transformer paper: a Diff model with
``num_heads = H`` has ``H/2`` differential heads, each with a query/key of ``head_dim``
per map and a value of ``2 * head_dim``; its parameter count equals the Llama model's
plus ``4 * head_dim * n_layers`` (the lambda vectors).
"""

from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields

from outlierscope.errors import ParamError

ROLES = ("transformer", "diff")
DEFAULT_PAIR = ("pair-tiny:transformer", "pair-tiny:diff")  # the bundled matched pair: default of sweep and reproduce
"""The bundled matched pair (a Transformer and a Diff Transformer trained alike by this project): the models a
sweep or reproduce run takes when none is named."""


@dataclass(frozen=True)
class PairConfig:
    """Architecture and training recipe of a matched Transformer / Diff Transformer pair (gpt-fast ``ModelArgs`` style).

    Attributes:
        name: the pair's name (``pair-tiny``, ...).
        vocab_size: the tokenizer's vocabulary.
        n_layers: decoder layers.
        hidden_size: the hidden states' channels.
        n_heads: attention heads (DiffLlama: ``n_heads / 2`` differential heads).
        n_kv_heads: key/value heads; -1: ``n_heads``.
        intermediate_size: the SwiGLU width; -1: 8/3 of ``hidden_size``, rounded up to a multiple of 32.
        seq_len: tokens per training sequence.
        rope_theta: the rotary base.
        rms_norm_eps: RMSNorm's epsilon.
        tie_word_embeddings: share the input embedding and the LM head.
        initializer_range: the weights' initial standard deviation.
        lambda_std_dev: the standard deviation of DiffLlama's initial lambda vectors.
        batch_size: training sequences per step (both roles).
        lr: the peak learning rate.
        min_lr_ratio: the cosine schedule's floor, as a fraction of ``lr``.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW's weight decay.
        grad_clip: the gradient norm's clip.
        betas: AdamW's betas."""

    name: str
    vocab_size: int = 8192
    n_layers: int = 4
    hidden_size: int = 128
    n_heads: int = 4
    n_kv_heads: int = -1
    intermediate_size: int = -1
    seq_len: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    lambda_std_dev: float = 0.1
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    head_dim: int = field(init=False)

    def __post_init__(self) -> None:
        if self.n_kv_heads == -1:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.intermediate_size == -1:
            ff = int(8 * self.hidden_size / 3)
            object.__setattr__(self, "intermediate_size", 32 * ((ff + 31) // 32))
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size must be divisible by n_heads, got {self.hidden_size} and {self.n_heads}")
        if self.n_heads % 2 or self.n_kv_heads % 2:
            raise ValueError(
                f"a matched pair needs an even number of heads and kv heads (the Diff model pairs them), "
                f"got n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads must be a multiple of n_kv_heads, got {self.n_heads} and {self.n_kv_heads}")
        object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)

    @classmethod
    def from_name(cls, name: str) -> PairConfig:
        """The preset pair of a name.

        Args:
            name: a key of ``PRESETS`` (``pair-tiny``, ...); an unknown one is refused with the closest names."""
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ParamError("preset", f"one of {', '.join(PRESETS)}", name, hint.removeprefix("; "))
        return PRESETS[name]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PairConfig:
        """The config a record stored (``asdict``); keys that are not init fields are ignored.

        Args:
            d: the stored fields."""
        init = {f.name for f in fields(cls) if f.init}
        kw = {k: v for k, v in d.items() if k in init}
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        return cls(**kw)

    def hf_config(self, role: str):
        """The transformers config of one role.

        Args:
            role: ``transformer`` (``LlamaConfig``) or ``diff`` (``DiffLlamaConfig``)."""
        from transformers import DiffLlamaConfig, LlamaConfig

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.n_layers,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.seq_len,
            initializer_range=self.initializer_range,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            attention_bias=False,
            attention_dropout=0.0,
            bos_token_id=None,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
        )
        if role == "transformer":
            return LlamaConfig(**common, mlp_bias=False)
        if role == "diff":
            return DiffLlamaConfig(**common, lambda_std_dev=self.lambda_std_dev)
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")

    def build(self, role: str, seed: int = 0):
        """A freshly initialised model of one role; both roles share every non-lambda weight for a seed.

        Args:
            role: ``transformer`` or ``diff``.
            seed: the initialisation's seed."""
        import torch
        from transformers import AutoModelForCausalLM

        cfg = self.hf_config(role)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        if role == "diff":
            # Identical init of the shared weights: copy them from the Llama model of the same seed.
            ref = self.build("transformer", seed)
            missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
            assert not unexpected and all(".lambda_" in k for k in missing), (missing, unexpected)
        return model

    def n_params(self, role: str) -> int:
        """The exact parameter count (tied embeddings counted once), computed from the shapes.

        Args:
            role: ``transformer`` or ``diff``."""
        d, L, ff, V = self.hidden_size, self.n_layers, self.intermediate_size, self.vocab_size
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        mlp = 3 * d * ff
        norms = 2 * d
        per_layer = attn + mlp + norms
        if role == "diff":
            per_layer += 4 * self.head_dim
        elif role != "transformer":
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        emb = V * d * (1 if self.tie_word_embeddings else 2)
        return emb + L * per_layer + d


EOS_ID = 0  # the byte-level BPE trained by `outlierscope train` puts <|endoftext|> first

PRESETS: dict[str, PairConfig] = {
    p.name: p
    for p in (
        # ~3.0M parameters: trained on 2 CPU cores for the bundled pair (fp32 weights < 25 MB for both).
        PairConfig(name="pair-tiny", vocab_size=6144, n_layers=4, hidden_size=192, n_heads=6, seq_len=256),
        # ~20M parameters: for a GPU.
        PairConfig(
            name="pair-small", vocab_size=8192, n_layers=8, hidden_size=384, n_heads=8, seq_len=512,
            batch_size=64, lr=2e-3,
        ),
        # ~110M parameters: GPT-2 small scale.
        PairConfig(
            name="pair-base", vocab_size=32768, n_layers=12, hidden_size=768, n_heads=12, seq_len=1024,
            batch_size=128, lr=1e-3,
        ),
        # A toy for tests: builds and trains in seconds.
        PairConfig(
            name="pair-test", vocab_size=512, n_layers=2, hidden_size=32, n_heads=4, seq_len=32,
            batch_size=4, warmup_steps=2,
        ),
    )
}
