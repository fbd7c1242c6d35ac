"""The one place for model dimensions: the typed `qwen35` hyperparameters and the presets we generate.

Everything that needs a shape (the GGUF writer, the loader's validation, the numpy reference, the
native engine's description) reads it from a `ModelConfig`; nothing repeats these numbers by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field, asdict
from typing import Callable

ARCH = "qwen35"

# Tensor types the engine accepts, by gguf.GGMLQuantizationType name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class ModelConfig:
    """qwen35 hyperparameters, named as llama.cpp's loader names them.

    `n_layer` counts the main layers only; the MTP (nextn) blocks follow them, so the GGUF
    `block_count` is `n_layer + n_layer_nextn` and the MTP block is `blk.{n_layer}`.
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, int, int, int]
    rope_freq_base: float
    rms_eps: float
    ssm_conv_kernel: int
    ssm_d_state: int          # key and value head dimension of the Gated DeltaNet
    ssm_n_group: int          # number of key heads
    ssm_dt_rank: int          # number of value heads
    full_attention_interval: int = 4
    n_layer_nextn: int = 1
    n_ctx_train: int = 262144

    # --- derived shapes -------------------------------------------------------------------
    @property
    def block_count(self) -> int:
        return self.n_layer + self.n_layer_nextn

    @property
    def ssm_d_inner(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_d_state * self.ssm_n_group

    @property
    def ssm_value_dim(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the causal conv: q, k (key_dim each) then v (value_dim)."""
        return 2 * self.ssm_key_dim + self.ssm_value_dim

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def mtp_layer(self) -> int | None:
        return self.n_layer if self.n_layer_nextn > 0 else None

    def is_recurrent(self, il: int) -> bool:
        """Layer il is Gated DeltaNet unless (il + 1) is a multiple of the interval (llama.cpp's rule)."""
        return il < self.n_layer and (il + 1) % self.full_attention_interval != 0

    def attention_layers(self) -> list[int]:
        return [il for il in range(self.n_layer) if not self.is_recurrent(il)]

    def deltanet_layers(self) -> list[int]:
        return [il for il in range(self.n_layer) if self.is_recurrent(il)]

    def gguf_metadata(self) -> dict[str, object]:
        """The architecture keys a qwen35 GGUF carries, with the values of this config."""
        a = ARCH
        return {
            f"{a}.context_length": self.n_ctx_train,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.block_count": self.block_count,
            f"{a}.feed_forward_length": self.n_ff,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": self.rms_eps,
            f"{a}.rope.freq_base": self.rope_freq_base,
            f"{a}.rope.dimension_count": self.n_rot,
            f"{a}.rope.dimension_sections": list(self.rope_sections),
            f"{a}.ssm.conv_kernel": self.ssm_conv_kernel,
            f"{a}.ssm.inner_size": self.ssm_d_inner,
            f"{a}.ssm.state_size": self.ssm_d_state,
            f"{a}.ssm.time_step_rank": self.ssm_dt_rank,
            f"{a}.ssm.group_count": self.ssm_n_group,
            f"{a}.full_attention_interval": self.full_attention_interval,
            f"{a}.nextn_predict_layers": self.n_layer_nextn,
        }

    @classmethod
    def from_gguf_metadata(cls, get: Callable[[str], object], n_vocab: int) -> "ModelConfig":
        """Build a config from a key lookup `get(key) -> value` (raises on a missing key).

        The loader wraps `get` so that a missing key becomes a `MissingKeyError` naming the file
        and the key; this function only knows the mapping.
        """
        a = ARCH
        block_count = int(get(f"{a}.block_count"))
        n_nextn = int(get(f"{a}.nextn_predict_layers"))
        sections = tuple(int(x) for x in get(f"{a}.rope.dimension_sections"))
        sections = (sections + (0, 0, 0, 0))[:4]
        key_len = int(get(f"{a}.attention.key_length"))
        return cls(
            n_vocab=n_vocab,
            n_embd=int(get(f"{a}.embedding_length")),
            n_layer=block_count - n_nextn,
            n_ff=int(get(f"{a}.feed_forward_length")),
            n_head=int(get(f"{a}.attention.head_count")),
            n_head_kv=int(get(f"{a}.attention.head_count_kv")),
            head_dim=key_len,
            n_rot=int(get(f"{a}.rope.dimension_count")),
            rope_sections=sections,  # type: ignore[arg-type]
            rope_freq_base=float(get(f"{a}.rope.freq_base")),
            rms_eps=float(get(f"{a}.attention.layer_norm_rms_epsilon")),
            ssm_conv_kernel=int(get(f"{a}.ssm.conv_kernel")),
            ssm_d_state=int(get(f"{a}.ssm.state_size")),
            ssm_n_group=int(get(f"{a}.ssm.group_count")),
            ssm_dt_rank=int(get(f"{a}.ssm.time_step_rank")),
            full_attention_interval=int(get(f"{a}.full_attention_interval")),
            n_layer_nextn=n_nextn,
            n_ctx_train=int(get(f"{a}.context_length")),
        )

    def to_dict(self) -> dict:
        return asdict(self)


# Presets. Every width that is the input dimension (ne0) of a matrix is a multiple of 256 so that
# llama.cpp's K-quants apply to it, as in the real 27B; otherwise its quantiser would fall back to
# types the engine does not support.
PRESETS: dict[str, ModelConfig] = {
    # A few MB; runs in CI in seconds. 3 DeltaNet + 1 attention.
    "tiny": ModelConfig(
        n_vocab=4096, n_embd=256, n_layer=4, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
        n_rot=16, rope_sections=(3, 3, 2, 0), rope_freq_base=1e7, rms_eps=1e-6,
        ssm_conv_kernel=4, ssm_d_state=64, ssm_n_group=4, ssm_dt_rank=12,
        n_ctx_train=4096,
    ),
    # Tens of MB (quantised); every head count and ratio of the 27B, narrower heads.
    "small": ModelConfig(
        n_vocab=4096, n_embd=512, n_layer=8, n_ff=1792, n_head=24, n_head_kv=4, head_dim=64,
        n_rot=16, rope_sections=(3, 3, 2, 0), rope_freq_base=1e7, rms_eps=1e-6,
        ssm_conv_kernel=4, ssm_d_state=32, ssm_n_group=16, ssm_dt_rank=48,
        n_ctx_train=32768,
    ),
    # The embedded default model, trained by training/ on the Python standard library (about 22 MB
    # as Q8_0). Widths are multiples of 128, enough for Q8_0; 384 is not a K-quant width.
    "default": ModelConfig(
        n_vocab=4096, n_embd=384, n_layer=8, n_ff=1024, n_head=6, n_head_kv=2, head_dim=64,
        n_rot=16, rope_sections=(3, 3, 2, 0), rope_freq_base=1e7, rms_eps=1e-6,
        ssm_conv_kernel=4, ssm_d_state=64, ssm_n_group=4, ssm_dt_rank=8,
        n_ctx_train=4096,
    ),
    # The exact Qwen3.8-27B text shapes.
    "q27b": ModelConfig(
        n_vocab=248320, n_embd=5120, n_layer=64, n_ff=17408, n_head=24, n_head_kv=4, head_dim=256,
        n_rot=64, rope_sections=(11, 11, 10, 0), rope_freq_base=1e7, rms_eps=1e-6,
        ssm_conv_kernel=4, ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=48,
        n_ctx_train=262144,
    ),
    # 64 layers like the 27B but narrow: llama.cpp's per-layer quant choices (use_more_bits)
    # depend on the layer index, so this is what proves our direct q27b type map.
    "q27b-narrow": ModelConfig(
        n_vocab=4096, n_embd=256, n_layer=64, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
        n_rot=16, rope_sections=(3, 3, 2, 0), rope_freq_base=1e7, rms_eps=1e-6,
        ssm_conv_kernel=4, ssm_d_state=64, ssm_n_group=4, ssm_dt_rank=12,
        n_ctx_train=4096,
    ),
}
