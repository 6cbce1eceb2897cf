"""A benchmark model of the size people split: a random-weight Llama-shaped GGUF of about 1B parameters.

    .venv/bin/python bench/bench_model.py              # writes it once, prints its path
    .venv/bin/python bench/bench_pipeline.py --model "$(.venv/bin/python bench/bench_model.py)"

The default model (135M) computes a token in ~15 ms on 2 cores, which makes a
pipeline's per-step costs (Python, sockets) look ten times larger than they are
for the models a pipeline is for. This one has Llama 3.2 1B's shape (n_embd
2048, 16 layers, 32 heads of which 8 KV, feed-forward 8192), SmolLM2's
tokenizer (49152 tokens, tied embeddings), Q4_0 weights (Q8_0 with --quant
q8_0) and f32 norms: about 1.07 billion parameters, 0.6 GB. The weights are
random, scaled so that activations stay finite: what it measures is compute
and transfer, the same as a trained model of that shape; its text means nothing
(greedy decoding settles on one token), so it is no prompt for speculation.
Written once into the model cache (`~/.cache/skippy/models/`), by numpy and the
gguf package, in about a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from skippyd.runtime.models import fetch_default_model, models_dir
from tests.tiny_model import load_tokenizer

QUANTS = {"q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
          "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}


def write_model(path: Path, *, quant: str = "q4_0", n_layer: int = 16, n_embd: int = 2048, n_head: int = 32,
                n_head_kv: int = 8, n_ff: int = 8192, seed: int = 0, progress=None) -> Path:
    """Write the model to `path` (atomically) and return it."""
    qtype, ftype = QUANTS[quant]
    tokenizer = load_tokenizer(fetch_default_model())
    n_vocab = len(next(f.value for f in tokenizer if f.key == gguf.Keys.Tokenizer.LIST))
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch="llama")
    writer.add_name(f"random llama {n_layer}x{n_embd}")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_context_length(8192)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for f in tokenizer:
        writer.add_key_value(f.key, f.value, f.vtype, sub_type=f.sub_type)

    def matrix(name: str, rows: int, cols: int, std: float | None = None) -> None:
        # outputs about as large as inputs (1/sqrt(fan_in)): the residual stream stays finite through the layers
        data = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std or cols ** -0.5)
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    kv = head_dim * n_head_kv
    matrix("token_embd.weight", n_vocab, n_embd, std=1.0)
    for i in range(n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        matrix(f"blk.{i}.attn_k.weight", kv, n_embd)
        matrix(f"blk.{i}.attn_v.weight", kv, n_embd)
        matrix(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
        if progress is not None:
            progress(i + 1, n_layer)
    norm("output_norm.weight")
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", choices=sorted(QUANTS), default="q4_0")
    ap.add_argument("--out", type=Path, default=None, help="where to write it (default: the model cache)")
    args = ap.parse_args()
    path = args.out or models_dir() / f"bench-llama-1b-{args.quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        write_model(path, quant=args.quant,
                    progress=lambda done, total: print(f"bench_model: layer {done}/{total}", file=sys.stderr))
        print(f"bench_model: wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in "
              f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
