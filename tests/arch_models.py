"""Tiny random-weight GGUF models of the architectures a pipeline splits, for split tests.

Each writer gives a complete model that libllama loads as is: the metadata its
loader reads (llama.cpp `src/models/<arch>.cpp`, `load_arch_hparams`) and
exactly the tensors `load_arch_tensors` creates, in its shapes (numpy order,
the reverse of ggml's). The layer patterns that make a layer's absolute index
matter are real and small: sliding windows of 16 tokens (gemma2: SWA on even
layers; gemma3: five SWA layers then one global; gpt-oss: SWA on even
layers), leading dense layers before MoE ones (deepseek2), input scaling by
sqrt(n_embd) (gemma2).

Weights are scaled so that each sublayer adds about as much to the residual
stream as the token embedding holds (projections 1/sqrt(fan_in), norms near
1) and queries 4 times larger, so that attention is sharp (each position
reads a few tokens, chosen by content, rather than the context's average):
activations stay finite, what attention sees matters (which layers slide
their window changes the output), and greedy tokens depend on the context
rather than repeating one token.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from tests.tiny_model import MetadataField, write_tiny_llama

SLIDING_WINDOW = 16


class _Model:
    """A GGUF being written: the shared header, then tensors added by the architecture's writer."""

    def __init__(self, path: Path, arch: str, tokenizer: Sequence[MetadataField], *, n_layer: int, seed: int,
                 n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, head_dim: int = 16, n_ff: int = 128,
                 embd_std: float = 1.0, q_gain: float = 4.0):
        self.arch = arch
        self.n_layer, self.n_embd, self.n_ff = n_layer, n_embd, n_ff
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.q_gain = q_gain
        self.n_vocab = len(next(f.value for f in tokenizer if f.key == gguf.Keys.Tokenizer.LIST))
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self.hparams: dict[str, bool | int | float] = {}  # written last: an architecture may override a default
        self.writer = gguf.GGUFWriter(path, arch=arch)
        self.writer.add_name("tiny random model")  # not the arch: llama.cpp keys token fixes on names like "phi3"
        self.writer.add_type(gguf.GGUFType.MODEL)
        self.writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        self.writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        self.key("context_length", 2048)
        self.key("embedding_length", n_embd)
        self.key("block_count", n_layer)
        self.key("feed_forward_length", n_ff)
        self.key("attention.head_count", n_head)
        self.key("attention.head_count_kv", n_head_kv)
        self.key("attention.key_length", head_dim)
        self.key("attention.value_length", head_dim)
        self.key("rope.dimension_count", head_dim)
        self.key("attention.layer_norm_rms_epsilon", 1e-6)
        self.key("vocab_size", self.n_vocab)
        self.tensor("token_embd.weight", self.random(embd_std, self.n_vocab, n_embd))
        self.norm("output_norm.weight", n_embd)

    def key(self, suffix: str, value: bool | int | float) -> None:
        """`{arch}.{suffix}` = value (the last value given for a key wins)."""
        self.hparams[suffix] = value

    def random(self, std: float, *shape: int) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def tensor(self, name: str, data: np.ndarray) -> None:
        # matrices in f16 as in real files; vectors (norms, biases, sinks) in f32, as ggml wants them
        self.writer.add_tensor(name, data.astype(np.float16 if data.ndim >= 2 else np.float32))

    def weight(self, name: str, *shape: int, gain: float = 1.0) -> None:
        """A projection of numpy shape (..., n_out, n_in), scaled so its outputs are about `gain` times as large
        as its inputs."""
        self.tensor(name, self.random(gain * shape[-1] ** -0.5, *shape))

    def bias(self, name: str, *shape: int) -> None:
        self.writer.add_tensor(name, self.random(0.1, *shape))  # f32 whatever its rank (expert biases are 2-D)

    def norm(self, name: str, n: int, gain: float = 1.0) -> None:
        self.tensor(name, gain * (1.0 + self.random(0.1, n)))

    def output(self) -> None:
        """An untied LM head (tied models leave it out: the loader falls back to token_embd)."""
        self.weight("output.weight", self.n_vocab, self.n_embd)

    def attention(self, i: int, *, bias: bool = False, qk_norm: bool = False, fused: bool = False,
                  sinks: bool = False, out_bias: bool = False, post_norm: bool = False) -> None:
        blk, q, kv = f"blk.{i}", self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        self.norm(f"{blk}.attn_norm.weight", self.n_embd)
        if fused:
            self.weight(f"{blk}.attn_qkv.weight", q + 2 * kv, self.n_embd)
        else:
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                self.weight(f"{blk}.{name}.weight", n, self.n_embd, gain=self.q_gain if name == "attn_q" else 1.0)
                if bias:
                    self.bias(f"{blk}.{name}.bias", n)
        if qk_norm:
            self.norm(f"{blk}.attn_q_norm.weight", self.head_dim, self.q_gain)
            self.norm(f"{blk}.attn_k_norm.weight", self.head_dim)
        self.weight(f"{blk}.attn_output.weight", self.n_embd, q)
        if out_bias:
            self.bias(f"{blk}.attn_output.bias", self.n_embd)
        if sinks:
            self.bias(f"{blk}.attn_sinks.weight", self.n_head)
        if post_norm:
            self.norm(f"{blk}.post_attention_norm.weight", self.n_embd)

    def ffn(self, i: int, *, fused_up: bool = False, post_norm: bool = False) -> None:
        """A gated feed-forward block (phi3 fuses gate and up into one ffn_up of twice the width)."""
        blk = f"blk.{i}"
        self.norm(f"{blk}.ffn_norm.weight", self.n_embd)
        if fused_up:
            self.weight(f"{blk}.ffn_up.weight", 2 * self.n_ff, self.n_embd)
        else:
            self.weight(f"{blk}.ffn_gate.weight", self.n_ff, self.n_embd)
            self.weight(f"{blk}.ffn_up.weight", self.n_ff, self.n_embd)
        self.weight(f"{blk}.ffn_down.weight", self.n_embd, self.n_ff)
        if post_norm:
            self.norm(f"{blk}.post_ffw_norm.weight", self.n_embd)

    def moe_shape(self, *, n_expert: int = 4, n_used: int = 2, n_ff_exp: int = 32, shared: int = 0) -> None:
        """The experts of every MoE layer: `n_expert` of width `n_ff_exp`, `n_used` routed per token, and
        `shared` always-on ones."""
        self.key("expert_count", n_expert)
        self.key("expert_used_count", n_used)
        self.key("expert_feed_forward_length", n_ff_exp)
        if shared:
            self.key("expert_shared_count", shared)

    def moe(self, i: int, *, bias: bool = False, probs_bias: bool = False) -> None:
        """Layer i's experts as `moe_shape` set them; the router's weights are larger than a projection's,
        so that different tokens pick different experts."""
        blk = f"blk.{i}"
        n_expert, n_ff_exp = self.hparams["expert_count"], self.hparams["expert_feed_forward_length"]
        shared = self.hparams.get("expert_shared_count", 0)
        self.tensor(f"{blk}.ffn_gate_inp.weight", self.random(1.0, n_expert, self.n_embd))
        for name, shape in (("gate", (n_ff_exp, self.n_embd)), ("up", (n_ff_exp, self.n_embd)),
                            ("down", (self.n_embd, n_ff_exp))):
            self.weight(f"{blk}.ffn_{name}_exps.weight", n_expert, *shape)
            if bias:
                self.bias(f"{blk}.ffn_{name}_exps.bias", n_expert, shape[0])
        if bias:
            self.bias(f"{blk}.ffn_gate_inp.bias", n_expert)
        if probs_bias:
            self.bias(f"{blk}.exp_probs_b.bias", n_expert)
        if shared:
            width = shared * n_ff_exp
            self.weight(f"{blk}.ffn_gate_shexp.weight", width, self.n_embd)
            self.weight(f"{blk}.ffn_up_shexp.weight", width, self.n_embd)
            self.weight(f"{blk}.ffn_down_shexp.weight", self.n_embd, width)

    def close(self) -> None:
        for suffix, value in self.hparams.items():
            # typed as the loader reads them: bool, u32 or f32
            vtype = (gguf.GGUFValueType.BOOL if isinstance(value, bool) else
                     gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.FLOAT32)
            self.writer.add_key_value(f"{self.arch}.{suffix}", value, vtype)
        for f in self.tokenizer:
            self.writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)
        self.writer.write_header_to_file()
        self.writer.write_kv_data_to_file()
        self.writer.write_tensors_to_file()
        self.writer.close()


# --- one writer per architecture: what its loader and graph builder want --------------------------------------


def _qwen2(m: _Model) -> None:
    m.key("rope.freq_base", 1e6)
    for i in range(m.n_layer):
        m.attention(i, bias=True)
        m.ffn(i)
    m.output()


def _qwen3(m: _Model) -> None:
    # head_dim 32 with 4 heads in a 64-wide model: the q projection is wider than n_embd, as in Qwen3
    m.key("rope.freq_base", 1e6)
    for i in range(m.n_layer):
        m.attention(i, qk_norm=True)
        m.ffn(i)
    # tied: no output.weight, the LM head is token_embd


def _qwen3moe(m: _Model) -> None:
    m.key("rope.freq_base", 1e6)
    m.moe_shape()
    for i in range(m.n_layer):
        m.attention(i, qk_norm=True)
        m.norm(f"blk.{i}.ffn_norm.weight", m.n_embd)
        m.moe(i)
    m.output()


def _gemma2(m: _Model) -> None:
    # the loader sets SWA on even layers (pattern 2) and scales the token embeddings by sqrt(n_embd)
    m.key("attention.sliding_window", SLIDING_WINDOW)
    m.key("attn_logit_softcapping", 50.0)
    m.key("final_logit_softcapping", 30.0)
    for i in range(m.n_layer):
        m.attention(i, post_norm=True)
        m.ffn(i, post_norm=True)


def _gemma3(m: _Model) -> None:
    # the loader sets five SWA layers then one global (pattern 6); SWA layers rotate with their own base
    m.key("attention.sliding_window", SLIDING_WINDOW)
    m.key("rope.freq_base", 1e6)
    m.key("rope.freq_base_swa", 1e4)
    for i in range(m.n_layer):
        m.attention(i, qk_norm=True, post_norm=True)
        m.ffn(i, post_norm=True)


def _phi3(m: _Model) -> None:
    # fused qkv and gate/up; the loader reads and then disables a sliding window; rope factors are
    # model-wide tensors (every stage needs them)
    m.key("attention.sliding_window", SLIDING_WINDOW)
    m.key("rope.scaling.original_context_length", 4096)  # above every test context: the short factors
    for name in ("rope_factors_long.weight", "rope_factors_short.weight"):
        m.tensor(name, 1.0 + np.abs(m.random(1.0, m.head_dim // 2)))
    for i in range(m.n_layer):
        m.attention(i, fused=True)
        m.ffn(i, fused_up=True)
    m.output()


def _gpt_oss(m: _Model) -> None:
    # the loader sets SWA on even layers (pattern 2); attention sinks; experts with biases
    m.key("attention.sliding_window", SLIDING_WINDOW)
    m.key("rope.freq_base", 1.5e5)
    m.moe_shape()
    for i in range(m.n_layer):
        m.attention(i, bias=True, sinks=True, out_bias=True, post_norm=True)
        m.moe(i, bias=True)
    m.output()


# DeepSeek-V2/V3 multi-head latent attention, as convert_hf_to_gguf writes it (MLA, one KV head)
_DS_Q_LORA, _DS_KV_LORA, _DS_ROPE, _DS_NOPE, _DS_V = 32, 32, 8, 16, 16
_DS_DENSE_LEAD = 2


def _deepseek2(m: _Model) -> None:
    m.key("leading_dense_block_count", _DS_DENSE_LEAD)
    m.key("attention.q_lora_rank", _DS_Q_LORA)
    m.key("attention.kv_lora_rank", _DS_KV_LORA)
    m.key("attention.key_length", _DS_KV_LORA + _DS_ROPE)
    m.key("attention.value_length", _DS_KV_LORA)
    m.key("attention.key_length_mla", _DS_NOPE + _DS_ROPE)
    m.key("attention.value_length_mla", _DS_V)
    m.key("attention.head_count_kv", 1)
    m.key("rope.dimension_count", _DS_ROPE)
    m.key("expert_weights_scale", 2.5)
    m.key("expert_weights_norm", True)
    m.key("expert_gating_func", int(gguf.ExpertGatingFuncType.SIGMOID))
    m.moe_shape(shared=1)
    for i in range(m.n_layer):
        blk = f"blk.{i}"
        m.norm(f"{blk}.attn_norm.weight", m.n_embd)
        m.weight(f"{blk}.attn_q_a.weight", _DS_Q_LORA, m.n_embd)
        m.norm(f"{blk}.attn_q_a_norm.weight", _DS_Q_LORA)
        m.weight(f"{blk}.attn_q_b.weight", m.n_head * (_DS_NOPE + _DS_ROPE), _DS_Q_LORA)
        m.weight(f"{blk}.attn_kv_a_mqa.weight", _DS_KV_LORA + _DS_ROPE, m.n_embd)
        m.norm(f"{blk}.attn_kv_a_norm.weight", _DS_KV_LORA)
        m.weight(f"{blk}.attn_k_b.weight", m.n_head, _DS_KV_LORA, _DS_NOPE)
        m.weight(f"{blk}.attn_v_b.weight", m.n_head, _DS_V, _DS_KV_LORA)
        m.weight(f"{blk}.attn_output.weight", m.n_embd, m.n_head * _DS_V)
        if i < _DS_DENSE_LEAD:
            m.ffn(i)
        else:
            m.norm(f"{blk}.ffn_norm.weight", m.n_embd)
            m.moe(i, probs_bias=True)
    m.output()


def _mistral3(m: _Model) -> None:
    # llama 4 style attention temperature (by position, from 64 tokens on) and a model-wide rope_freqs
    m.key("rope.freq_base", 1e6)
    m.key("attention.temperature_scale", 0.1)
    m.key("rope.scaling.original_context_length", 64)
    m.tensor("rope_freqs.weight", 1.0 + np.abs(m.random(1.0, m.head_dim // 2)))
    for i in range(m.n_layer):
        m.attention(i)
        m.ffn(i)
    m.output()


@attrs.frozen
class ArchModel:
    """How to write one architecture's tiny model."""

    n_layer: int
    write: Callable[[_Model], None] | None  # None: tests.tiny_model's llama
    shape: dict[str, Any] = attrs.Factory(dict)  # _Model's dimensions where the defaults do not fit


ARCH_MODELS: dict[str, ArchModel] = {
    "llama": ArchModel(4, None),
    "qwen2": ArchModel(4, _qwen2),
    "qwen3": ArchModel(4, _qwen3, {"head_dim": 32, "embd_std": 0.1}),
    "qwen3moe": ArchModel(4, _qwen3moe),
    # gemma scales the embedding input by sqrt(64) = 8; tied models need small embeddings, or the LM head
    # (the same matrix) favours the token just read
    "gemma2": ArchModel(6, _gemma2, {"embd_std": 0.05, "n_head_kv": 1}),
    "gemma3": ArchModel(12, _gemma3, {"embd_std": 0.05, "n_head_kv": 1}),
    "phi3": ArchModel(4, _phi3),
    "gpt-oss": ArchModel(6, _gpt_oss),
    "deepseek2": ArchModel(6, _deepseek2),
    "mistral3": ArchModel(4, _mistral3),
}


def write_arch_model(arch: str, path: str | os.PathLike[str], tokenizer: Sequence[MetadataField], *,
                     seed: int = 0) -> Path:
    """Write the tiny `arch` model to `path` with `tokenizer` (e.g. the 512-token `small_vocabulary`)."""
    path = Path(path)
    spec = ARCH_MODELS[arch]
    if spec.write is None:
        return write_tiny_llama(path, tokenizer_from=tokenizer, n_layer=spec.n_layer, seed=seed)
    model = _Model(path, arch, tokenizer, n_layer=spec.n_layer, seed=seed, **spec.shape)
    spec.write(model)
    model.close()
    return path
