"""Which model architectures a pipeline can split, and why the others cannot be.

A stage file holds a contiguous range of layers renumbered from 0 and the
whole model's hyperparameters; the patched libllama reads them for the whole
model, then takes each per-layer property (sliding-window or full attention,
RoPE or not, dense or MoE, head and feed-forward counts) from the stage's own
absolute layers, and a stage after the first skips what belongs to token
embeddings (input scaling, embedding norms, learned positions). An
architecture splits when its graph builder only reads per-layer properties
through those arrays (or through the builder edits in native/patches), names
every layer's output ``l_out``, and passes nothing from one layer to the next
but the residual stream.

Every architecture of the pinned llama.cpp is in `ARCHITECTURES` with one of
three verdicts: verified by a test here, the same mechanism but not verified
here, or refused with the reason.
"""

from __future__ import annotations

import enum

import attrs


class Verdict(enum.Enum):
    VERIFIED = "splits (verified by test)"
    SAME_MECHANISM = "splits (same mechanism, not verified here)"
    REFUSED = "refused"


@attrs.frozen
class Support:
    verdict: Verdict
    reason: str = ""

    @property
    def splits(self) -> bool:
        return self.verdict is not Verdict.REFUSED

    def describe(self) -> str:
        return f"{self.verdict.value}: {self.reason}" if self.reason else self.verdict.value


def _verified() -> Support:
    return Support(Verdict.VERIFIED)


def _same() -> Support:
    return Support(Verdict.SAME_MECHANISM)


def _refused(reason: str) -> Support:
    return Support(Verdict.REFUSED, reason)


_UNKNOWN = _refused("not an architecture of the pinned llama.cpp build")

_RECURRENT = (
    "its recurrent state cannot be rolled back to an earlier position "
    "(speculative decoding, resume and the prefix cache need that)"
)
_ENCODER = "an encoder or embedding model: it keeps no KV cache and generates no text"
_DIFFUSION = "a diffusion language model: it denoises whole blocks without a causal KV cache"
_DRAFT = "a draft model that reads another model's hidden states, not a model to split"
_SPEECH = "a text-to-speech backbone whose output feeds an audio model, not a text generator"
_HYPER = "hyper-connections widen the residual stream beyond the n_embd floats a stage passes on"

ARCHITECTURES: dict[str, Support] = {
    # Verified by tests that split random-weight models and compare the stages with the whole model.
    "llama": _verified(),
    "qwen2": _verified(),
    "qwen3": _verified(),
    "qwen3moe": _verified(),
    "phi3": _verified(),
    "gemma2": _verified(),
    "gemma3": _verified(),
    "gpt-oss": _verified(),
    "deepseek2": _verified(),
    "mistral3": _verified(),
    # Plain decoder stacks: per-layer properties come only from the shifted arrays
    # (sliding-window pattern, head and feed-forward counts, leading dense layers).
    "apertus": _same(),
    "arcee": _same(),
    "arctic": _same(),
    "baichuan": _same(),
    "bailingmoe": _same(),
    "bailingmoe2": _same(),
    "bitnet": _same(),
    "chameleon": _same(),
    "chatglm": _same(),
    "codeshell": _same(),
    "cohere2": _same(),
    "cohere2moe": _same(),
    "dbrx": _same(),
    "deepseek": _same(),
    "deepseek2-ocr": _same(),
    "deepseek32": _same(),
    "dots1": _same(),
    "dots3note": _same(),
    "ernie4_5": _same(),
    "exaone": _same(),
    "exaone4": _same(),
    "exaone-moe": _same(),
    "falcon": _same(),
    "gptneox": _same(),
    "granite": _same(),
    "granite_swa": _same(),
    "granitemoe": _same(),
    "grok": _same(),
    "grovemoe": _same(),
    "hunyuan-dense": _same(),
    "hunyuan-moe": _same(),
    "hy_v3": _same(),
    "internlm2": _same(),
    "jais": _same(),
    "jais2": _same(),
    "laguna": _same(),
    "maincoder": _same(),
    "maple": _same(),
    "mellum": _same(),
    "mimo2": _same(),
    "minicpm": _same(),
    "minimax-m2": _same(),
    "minimax-m3": _same(),
    "mistral4": _same(),
    "nemotron": _same(),
    "olmo": _same(),
    "olmo2": _same(),
    "olmoe": _same(),
    "openelm": _same(),
    "orion": _same(),
    "pangu-embedded": _same(),
    "phi2": _same(),
    "phimoe": _same(),
    "plamo": _same(),
    "plamo3": _same(),
    "plm": _same(),
    "qwen": _same(),
    "qwen2moe": _same(),
    "refact": _same(),
    "seed_oss": _same(),
    "spark2_5": _same(),
    "stablelm": _same(),
    "starcoder2": _same(),
    "step35": _same(),
    "xverse": _same(),
    # Split with a builder edit in native/patches: a stage after the first skips the
    # token-embedding scaling, norm or learned positions; layer patterns ("every n-th
    # layer is MoE / has no RoPE") count the model's layers; depth-dependent scales
    # and tensor checks use the whole model's depth.
    "afmoe": _same(),
    "bloom": _same(),
    "cogvlm": _same(),
    "command-r": _same(),
    "deci": _same(),
    "ernie4_5-moe": _same(),
    "gemma": _same(),
    "glm4": _same(),
    "glm4moe": _same(),
    "gpt2": _same(),
    "llama4": _same(),
    "minicpm3": _same(),
    "mpt": _same(),
    "muse-glimmer": _same(),
    "smallthinker": _same(),
    "smollm3": _same(),
    "starcoder": _same(),
    # Recurrent or hybrid (state-space, linear attention, short convolutions).
    "arwkv7": _refused(_RECURRENT),
    "bailingmoe3": _refused(_RECURRENT),
    "falcon-h1": _refused(_RECURRENT),
    "glm5-next": _refused(_RECURRENT),
    "granitehybrid": _refused(_RECURRENT),
    "jamba": _refused(_RECURRENT),
    "kimi-k3": _refused(_RECURRENT),
    "kimi-linear": _refused(_RECURRENT),
    "lfm2": _refused(_RECURRENT),
    "lfm2moe": _refused(_RECURRENT),
    "mamba": _refused(_RECURRENT),
    "mamba2": _refused(_RECURRENT),
    "minimax-01": _refused(_RECURRENT),
    "nemotron_h": _refused(_RECURRENT),
    "nemotron_h_moe": _refused(_RECURRENT),
    "plamo2": _refused(_RECURRENT),
    "qwen35": _refused(_RECURRENT),
    "qwen35moe": _refused(_RECURRENT),
    "qwen3next": _refused(_RECURRENT),
    "qwen4exp": _refused(_RECURRENT),
    "rwkv6": _refused(_RECURRENT),
    "rwkv6qwen2": _refused(_RECURRENT),
    "rwkv7": _refused(_RECURRENT),
    # State other than the residual stream flows between layers, or the input is wider.
    "deepseek4": _refused(_HYPER),
    "hy_v4": _refused(_HYPER),
    "gemma3n": _refused(
        "AltUp keeps several residual streams, every layer reads per-layer token embeddings "
        "and later layers reuse earlier layers' KV caches"
    ),
    "gemma4": _refused(
        "its smaller variants feed per-layer token embeddings to every layer "
        "and reuse earlier layers' KV caches in later layers"
    ),
    "glm-dsa": _refused(
        "shared indexer layers reuse the top-k selection of an earlier layer, which a stage boundary cuts off"
    ),
    "graniteswitch": _refused(
        "an extra router layer picks each token's adapter from its token id; later stages have neither"
    ),
    "hrm_text": _refused("its layer stacks run in loops over the same weights, so layers are not a straight sequence"),
    "nanbeige": _refused("its layers can run in loops over the same weights, so layers are not a straight sequence"),
    "qwen3vl": _refused("deepstack makes its input wider than n_embd"),
    "qwen3vlmoe": _refused("deepstack makes its input wider than n_embd"),
    "talkie": _refused("every layer adds the normalised token embedding, which a later stage does not receive"),
    # Multi-section rotary positions (vision-language decoders): a prefill chunk of an image's rows carries their
    # positions, four per row (skippy-protocol(7)); qwen2vl is verified by the image tests (tests/test_images.py)
    "hunyuan_vl": _same(),
    "paddleocr": _same(),
    "qwen2vl": _verified(),
    # Encoders, embedding models, encoder-decoders.
    "bert": _refused(_ENCODER),
    "eurobert": _refused(_ENCODER),
    "gemma-embedding": _refused(_ENCODER),
    "jina-bert-v2": _refused(_ENCODER),
    "jina-bert-v3": _refused(_ENCODER),
    "llama-embed": _refused(_ENCODER),
    "modern-bert": _refused(_ENCODER),
    "neo-bert": _refused(_ENCODER),
    "nomic-bert": _refused(_ENCODER),
    "nomic-bert-moe": _refused(_ENCODER),
    "t5": _refused("an encoder-decoder model: its decoder reads the encoder's output in every layer"),
    "t5encoder": _refused(_ENCODER),
    # Diffusion language models (non-causal).
    "dream": _refused(_DIFFUSION),
    "llada": _refused(_DIFFUSION),
    "llada-moe": _refused(_DIFFUSION),
    "rnd1": _refused(_DIFFUSION),
    # Draft models for speculative decoding.
    "dflash": _refused(_DRAFT),
    "eagle3": _refused(_DRAFT),
    "gemma4-assistant": _refused(_DRAFT),
    # Speech.
    "pockettts": _refused(_SPEECH),
    "qwen3tts": _refused(_SPEECH),
    "wavtokenizer-dec": _refused("an audio decoder whose blocks are not blk.N transformer layers"),
    # Not a language model file, or not implemented by the pinned build.
    "clip": _refused("a vision encoder (mmproj) file, not a language model"),
    "gptj": _refused("the pinned llama.cpp has no implementation of it"),
    "(unknown)": _refused("llama.cpp's placeholder for an architecture name it does not know"),
}


def support(arch: str) -> Support:
    """The verdict for `arch` (a `general.architecture` value)."""
    return ARCHITECTURES.get(arch, _UNKNOWN)


def markdown() -> str:
    """ARCHITECTURES.md: the table for the docs (`python -m skippyd.runtime.architectures > ARCHITECTURES.md`)."""
    counts = {v: sum(1 for s in ARCHITECTURES.values() if s.verdict is v) for v in Verdict}
    lines = [
        "# Architectures skippy splits",
        "",
        "Every architecture of the pinned llama.cpp (llama-cpp-python 0.3.36's `vendor/llama.cpp`), as "
        "`skippyctl model architectures` and `skippyctl model inspect` give it: "
        + ", ".join(f"{counts[v]} {v.value}" for v in Verdict) + ".",
        "",
        "A stage file holds a contiguous range of layers and the whole model's hyperparameters; the patched "
        "libllama takes every per-layer property (sliding-window or full attention, RoPE or not, dense or MoE, "
        "head and feed-forward counts) from the stage's absolute layers, and a stage after the first skips what "
        "belongs to token embeddings. *Verified* architectures are split by the test suite in 2 and 3 stages at "
        "boundaries that cross their layer patterns, and give the whole model's logits bit for bit. The others "
        "of the same mechanism have graph builders that read per-layer properties the same way; refused ones "
        "say why. Generated from `skippyd/runtime/architectures.py`.",
        "",
        "| architecture | splits |",
        "|---|---|",
    ]
    order = {Verdict.VERIFIED: 0, Verdict.SAME_MECHANISM: 1, Verdict.REFUSED: 2}
    for name, s in sorted(ARCHITECTURES.items(), key=lambda kv: (order[kv[1].verdict], kv[0])):
        lines.append(f"| `{name}` | {s.describe()} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
