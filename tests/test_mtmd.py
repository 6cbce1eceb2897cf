"""Images through a pipeline, in one process: libmtmd's projector on the first stage, an image's rows and the
text's tokens evaluated chunk by chunk in prompt order (as llama.cpp's ``mtmd_helper_eval_chunks`` does), hidden
states onward with their rows' positions; greedy tokens equal across 1, 2 and 3 stages and equal to llama.cpp's
own multimodal path (llama-cpp-python's mtmd bindings over the same build).

Fixtures (tests/mm_models.py): SmolVLM's projector type (idefics3) at the default model's width, with the
default model given SmolVLM's image tokens; and a small Qwen2-VL pair (M-RoPE: an image's rows take 4 positions
each, and fewer positions than rows).
"""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path

import numpy as np
import pytest

from skippyd.runtime import mtmd
from skippyd.runtime.llama import ClosedError, ContextParams, InvalidArgumentError, Model
from skippyd.runtime.llama.ffi import ffi, lib
from skippyd.runtime.slicing import split_model
from tests.llama_cpp_reference import install_llama_cpp, mtmd_greedy_tokens
from tests.local_pipeline import LocalPipeline
from tests.mm_models import (
    QWEN2VL_TOKENS,
    SMOLVLM_TOKENS,
    claimed_size,
    image_bytes,
    write_idefics3_projector,
    write_qwen2vl_projector,
    write_qwen2vl_text_model,
    write_smolvlm_text_model,
)

PARAMS = ContextParams(n_ctx_per_seq=1024, n_seq_max=1, n_batch=512, n_ubatch=512)
N_TOKENS = 16
MARKER = "<__media__>"


def _chat(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


# prompt (with markers) -> the images' (width, height, seed, format)
SMOLVLM_PROMPTS = {
    "image inside the text": (_chat(f"What is in this picture {MARKER} and why?"), [(48, 40, 1, "PNG")]),
    "image before the text": (f"{MARKER}" + _chat("Describe the picture above."), [(64, 24, 2, "JPEG")]),
    "image after the text": (_chat("Here is the picture: ") + MARKER, [(30, 30, 3, "PNG")]),
    "two images": (_chat(f"Compare {MARKER} with {MARKER}, please."), [(40, 56, 4, "JPEG"), (56, 40, 5, "PNG")]),
}


@pytest.fixture(scope="module")
def smolvlm(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Path]]:
    """The default model with SmolVLM's image tokens, whole and split in 2 and 3 stages: {stages: files}."""
    work = tmp_path_factory.mktemp("smolvlm")
    model = write_smolvlm_text_model(default_model_path, work / "smolvlm-text.gguf")
    out = {1: [model]}
    for n in (2, 3):
        out[n] = [s.file for s in split_model(model, None, work / f"split{n}", stages=n).stages]
    return out


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_idefics3_projector(tmp_path_factory.mktemp("idefics3") / "mmproj-idefics3.gguf")


@pytest.fixture(scope="module")
def head(smolvlm: dict[int, list[Path]]):
    """The whole model, loaded once for the projector to be paired with (the text chunks' vocabulary)."""
    with Model(smolvlm[1][0]) as model:
        yield model


@pytest.fixture(scope="module")
def projector(head: Model, idefics3: Path):
    with mtmd.Projector(head, idefics3, warmup=False) as p:
        yield p


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory: pytest.TempPathFactory):
    return install_llama_cpp(tmp_path_factory.mktemp("llama-cpp-python"))


def _images(specs) -> list[bytes]:
    return [image_bytes(w, h, seed=seed, fmt=fmt) for w, h, seed, fmt in specs]


def _chunks(projector: mtmd.Projector, prompt: str, images: list[bytes]) -> list[mtmd.Chunk]:
    bitmaps = [mtmd.Bitmap.from_bytes(b) for b in images]
    try:
        return projector.tokenize(prompt, bitmaps)
    finally:
        for b in bitmaps:
            b.close()


def _generate(paths: list[Path], chunks: list[mtmd.Chunk], n: int = N_TOKENS) -> tuple[int, list[int]]:
    with LocalPipeline(paths, PARAMS) as pipe:
        position = pipe.prefill_chunks(chunks)
        return position, pipe.continue_decode(position, n)


# --------------------------------------------------------------------------- the projector and its chunks


def test_projector_describes_itself(projector: mtmd.Projector):
    assert projector.projector_type == "idefics3"
    assert projector.supports_vision
    assert not projector.uses_mrope and projector.n_pos_per_embd == 1
    assert not projector.non_causal
    assert projector.marker == mtmd.default_marker() == MARKER
    assert projector.n_embd == 576


def test_an_image_becomes_tiles_framed_by_the_projectors_tokens(projector: mtmd.Projector, head: Model):
    data = image_bytes(48, 40, seed=1)
    chunks = _chunks(projector, _chat(f"Look: {MARKER}"), [data])
    images = [c for c in chunks if isinstance(c, mtmd.ImageChunk)]
    texts = [c for c in chunks if isinstance(c, mtmd.TextChunk)]
    # 48x40 is scaled to a longest edge of 64, so 2x2 tiles of 32 plus the global view, 4 rows each
    assert len(images) == 5 and len(texts) == 6
    assert all(isinstance(a, mtmd.TextChunk) != isinstance(b, mtmd.TextChunk) for a, b in zip(chunks, chunks[1:]))
    assert all(c.n_tokens == c.n_pos == 4 and c.grid is None and not c.non_causal for c in images)
    # every tile carries the image's id: the sha256 of its size and decoded pixels
    from PIL import Image

    rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert {c.id for c in images} == {hashlib.sha256(struct.pack("<II", 48, 40) + rgb.tobytes()).hexdigest()}
    framing = {head.tokenize(t, add_special=False)[0] for t in SMOLVLM_TOKENS[:1] + SMOLVLM_TOKENS[3:6]}
    framed = set(np.concatenate([c.tokens for c in texts]).tolist())
    assert framing <= framed  # <fake_token_around_image>, <global-img>, <row_1_col_1>, <row_1_col_2>
    assert mtmd.prompt_positions(chunks) == sum(c.n_tokens for c in chunks)
    assert mtmd.prompt_positions(chunks, 7) == 7 + sum(c.n_tokens for c in chunks)


def test_encoding_copies_rows_of_the_text_models_width(projector: mtmd.Projector):
    a, b = (next(c for c in _chunks(projector, MARKER, [image_bytes(32, 32, seed=s)])
                 if isinstance(c, mtmd.ImageChunk)) for s in (7, 8))
    rows = a.encode()
    assert rows.shape == (4, 576) and rows.dtype == np.float32 and rows.flags.owndata
    assert np.isfinite(rows).all() and rows.std() > 0.1
    assert np.array_equal(a.encode(), rows)  # the same image, the same rows
    assert not np.allclose(b.encode(), rows)
    np.testing.assert_array_equal(a.positions(10), np.arange(10, 14))
    a.close()
    a.close()
    with pytest.raises(ClosedError):
        a.encode()


# --------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def smolvlm_results(smolvlm, projector, idefics3, llama_cpp) -> dict[str, dict[str, list[int]]]:
    """For every prompt: the greedy tokens of 1, 2 and 3 stages and of llama-cpp-python."""
    out = {}
    for name, (prompt, specs) in SMOLVLM_PROMPTS.items():
        images = _images(specs)
        chunks = _chunks(projector, prompt, images)
        results = {}
        for n, paths in smolvlm.items():
            position, tokens = _generate(paths, chunks)
            assert position == mtmd.prompt_positions(chunks)
            results[f"{n} stages"] = tokens
        results["llama-cpp-python"] = mtmd_greedy_tokens(llama_cpp, smolvlm[1][0], idefics3, prompt, images,
                                                         N_TOKENS, n_batch=PARAMS.n_batch)
        out[name] = results
    return out


@pytest.mark.parametrize("prompt", list(SMOLVLM_PROMPTS))
def test_idefics3_prompt_gives_llama_cpps_tokens_on_1_2_and_3_stages(smolvlm_results, prompt: str):
    results = smolvlm_results[prompt]
    reference = results["llama-cpp-python"]
    assert len(reference) >= 8  # N_TOKENS, or fewer ending at the end of generation
    for name, tokens in results.items():
        assert tokens == reference, name


def test_the_image_decides_the_reply(smolvlm, projector):
    """The parity above means something: another image (same size, same prompt) changes the reply."""
    prompt, specs = SMOLVLM_PROMPTS["image inside the text"]
    (w, h, seed, fmt), = specs
    replies = {tuple(_generate(smolvlm[1], _chunks(projector, prompt, [image_bytes(w, h, seed=s, fmt=fmt)]))[1])
               for s in (seed, seed + 100)}
    assert len(replies) == 2


# --------------------------------------------------------------------------- M-RoPE (Qwen2-VL)


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory: pytest.TempPathFactory, small_tokenizer_fields) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("qwen2vl")
    return (write_qwen2vl_text_model(work / "qwen2vl.gguf", small_tokenizer_fields),
            write_qwen2vl_projector(work / "mmproj-qwen2vl.gguf"))


QWEN_PROMPT = f"Look at {MARKER} and at {MARKER} then say"
QWEN_IMAGES = [(48, 16, 3, "PNG"), (24, 40, 4, "JPEG")]


@pytest.fixture(scope="module")
def qwen_chunks(qwen2vl):
    text, proj = qwen2vl
    with Model(text) as model, mtmd.Projector(model, proj, warmup=False) as projector:
        assert projector.uses_mrope and projector.n_pos_per_embd == model.n_pos_per_embd == 4
        assert projector.projector_type == "qwen2vl_merger"
        yield _chunks(projector, QWEN_PROMPT, _images(QWEN_IMAGES))


def test_mrope_image_rows_take_four_positions_each(qwen_chunks, qwen2vl):
    images = [c for c in qwen_chunks if isinstance(c, mtmd.ImageChunk)]
    # 48x16 in 8x8 groups of 2x2 patches: 6x2 rows; 24x40: 3x5
    assert [(c.grid, c.n_tokens, c.n_pos) for c in images] == [((6, 2), 12, 6), ((3, 5), 15, 5)]
    start = 0
    for c in qwen_chunks:
        pos = c.positions(start)
        if isinstance(c, mtmd.ImageChunk):
            assert pos.shape == (4, c.n_tokens)
            # the pure arithmetic is libmtmd's own, row by row
            tokens = lib.mtmd_input_chunk_get_tokens_image(c._ptr)
            for i in range(c.n_tokens):
                d = lib.mtmd_image_tokens_get_decoder_pos(tokens, start, i)
                assert tuple(pos[:, i]) == (d.t, d.y, d.x, d.z)
        else:
            np.testing.assert_array_equal(pos, np.arange(start, start + c.n_tokens))
        start += c.n_pos
    assert mtmd.prompt_positions(qwen_chunks) == start < sum(c.n_tokens for c in qwen_chunks)
    vision_start = QWEN2VL_TOKENS.index("<|vision_start|>") + 512
    assert vision_start in qwen_chunks[0].tokens


def test_mrope_prompt_gives_llama_cpps_tokens(qwen2vl, qwen_chunks, llama_cpp):
    text, proj = qwen2vl
    position, tokens = _generate([text], qwen_chunks)
    reference = mtmd_greedy_tokens(llama_cpp, text, proj, QWEN_PROMPT, _images(QWEN_IMAGES), N_TOKENS,
                                   n_batch=PARAMS.n_batch)
    assert position == mtmd.prompt_positions(qwen_chunks)
    assert tokens == reference and len(tokens) == N_TOKENS


@pytest.fixture(scope="module")
def qwen_splits(qwen2vl, tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Path]]:
    """The Qwen2-VL model split in 2 and 3 stages: a stage after the first takes an image's rows with 4 positions
    each and a text token's hidden state with one."""
    text, _ = qwen2vl
    return {n: [s.file for s in split_model(text, None, tmp_path_factory.mktemp(f"qsplit{n}"), stages=n).stages]
            for n in (2, 3)}


@pytest.mark.parametrize("n_stages", [2, 3])
def test_mrope_rows_cross_stages_with_their_positions(qwen2vl, qwen_chunks, qwen_splits, n_stages: int):
    whole = _generate([qwen2vl[0]], qwen_chunks)
    assert _generate(qwen_splits[n_stages], qwen_chunks) == whole


def test_mrope_decode_steps_one_row_at_a_time(qwen2vl, qwen_chunks, qwen_splits):
    """The per-token call (decode_row) of a later stage gives a text token's hidden state its sections too."""
    position, expected = _generate([qwen2vl[0]], qwen_chunks)
    with LocalPipeline(qwen_splits[3], PARAMS) as pipe:
        assert pipe.prefill_chunks(qwen_chunks) == position
        with pytest.raises(InvalidArgumentError, match="first stage"):
            rows = np.zeros((1, pipe.models[1].n_embd_inp), dtype=np.float32)
            pipe.contexts[1].decode(np.array([position]), np.zeros(1, dtype=np.int32), input_embd=rows)
        tokens = [pipe.last.sample_row(0, None)]
        while len(tokens) < N_TOKENS:
            hidden = None
            for ctx in pipe.contexts:
                if ctx.token_input:
                    ctx.decode_row(position, 0, token=tokens[-1])
                else:
                    ctx.decode_row(position, 0, embd=hidden)
                if ctx.hidden_output:
                    hidden = ctx.hidden()
            tokens.append(pipe.last.sample_row(0, None))
            position += 1
    assert tokens == expected


def test_context_positions_are_checked(qwen2vl):
    with Model(qwen2vl[0]) as model, LocalPipeline([qwen2vl[0]], PARAMS) as pipe:
        ctx = pipe.contexts[0]
        rows = np.zeros((2, model.n_embd_inp), dtype=np.float32)
        seq = np.zeros(2, dtype=np.int32)
        tokens = np.array([1, 2], dtype=np.int32)
        with pytest.raises(InvalidArgumentError, match="4 per row"):
            ctx.decode(np.zeros((3, 2), dtype=np.int32), seq, input_embd=rows)
        with pytest.raises(InvalidArgumentError, match="4 per row"):
            ctx.decode(np.zeros((4, 2), dtype=np.int32), seq, tokens=tokens)
        with pytest.raises(InvalidArgumentError, match="in place of its token ids"):
            ctx.decode(np.arange(2), seq, tokens=tokens, input_embd=rows)
        with pytest.raises(InvalidArgumentError, match="not hidden states"):
            ctx.decode(np.arange(2), seq, embd=rows)  # hidden states go to later stages only, as before
        ctx.decode(np.zeros((4, 2), dtype=np.int32), seq, input_embd=rows)  # an image's rows at position 0
        assert ctx.kv_pos_range(0) == (0, 0)


def test_a_non_causal_batch_leaves_the_context_causal(tiny_model_small_vocab_path: Path):
    """causal=False (an image whose rows attend both ways) changes that batch only."""
    tokens, seq = np.array([5, 77, 301], dtype=np.int32), np.zeros(3, dtype=np.int32)
    params = ContextParams(n_ctx_per_seq=64, n_seq_max=2, n_batch=64, n_ubatch=64)
    with LocalPipeline([tiny_model_small_vocab_path], params) as both_ways, \
            LocalPipeline([tiny_model_small_vocab_path], params) as causal:
        both_ways.decode(tokens, np.arange(3), seq, causal=False)
        causal.decode(tokens, np.arange(3), seq)
        assert not np.allclose(both_ways.last.logits(0), causal.last.logits(0))
        both_ways.decode(tokens, np.arange(3), seq + 1)
        np.testing.assert_array_equal(both_ways.last.logits(1), causal.last.logits(0))


# --------------------------------------------------------------------------- refusals


def test_a_projector_of_another_width_is_refused_in_one_line(head: Model, tmp_path: Path):
    wrong = write_idefics3_projector(tmp_path / "mmproj-640.gguf", n_embd_text=640)
    with pytest.raises(mtmd.ProjectorLoadError) as err:
        mtmd.Projector(head, wrong, warmup=False)
    message = str(err.value)
    assert "\n" not in message
    assert "640" in message and "576" in message and "mmproj-640.gguf" in message


def test_a_file_that_is_not_a_projector_is_refused_naming_it(head: Model, tmp_path: Path, smolvlm):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x89PNG not a model")
    for path, why in ((junk, "not a GGUF file"), (smolvlm[2][0], "not a multimodal projector")):
        with pytest.raises(mtmd.ProjectorLoadError) as err:
            mtmd.Projector(head, path, warmup=False)
        message = str(err.value)
        assert "\n" not in message and str(path) in message and why in message


def test_an_images_size_comes_from_its_header_alone():
    for fmt in ("PNG", "JPEG"):
        assert mtmd.image_size(image_bytes(37, 11, seed=0, fmt=fmt)) == (37, 11)
    png = image_bytes(8, 8, seed=0)
    assert mtmd.image_size(claimed_size(png, 60000, 50000)) == (60000, 50000)  # what it says, never decoded
    for junk in (b"", b"not an image at all", png[:10]):
        assert mtmd.image_size(junk) is None


def test_the_same_pixels_are_the_same_image_whatever_the_file():
    png, bmp = image_bytes(12, 9, seed=3, fmt="PNG"), image_bytes(12, 9, seed=3, fmt="BMP")
    assert png != bmp
    with mtmd.Bitmap.from_bytes(png) as a, mtmd.Bitmap.from_bytes(bmp) as b, \
            mtmd.Bitmap.from_bytes(image_bytes(12, 9, seed=4)) as c:
        assert a.id == b.id != c.id


def test_bytes_that_are_not_an_image_raise_the_typed_error():
    for data in (b"", b"hello, this is not an image", b"RIFF\x00\x00\x00\x00WAVEfmt ", image_bytes(8, 8, seed=0)[:40]):
        with pytest.raises(mtmd.ImageDecodeError) as err:
            mtmd.Bitmap.from_bytes(data)
        assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    with mtmd.Bitmap.from_bytes(image_bytes(20, 10, seed=0, fmt="JPEG")) as bitmap:
        assert bitmap.size == (20, 10)


def test_markers_must_match_the_images(projector: mtmd.Projector):
    with mtmd.Bitmap.from_bytes(image_bytes(16, 16, seed=0)) as bitmap:
        with pytest.raises(mtmd.TokenizeError, match="2 image markers"):
            projector.tokenize(f"{MARKER}{MARKER}", [bitmap])
        bitmap.close()
        with pytest.raises(ClosedError):
            projector.tokenize(MARKER, [bitmap])


def test_a_text_model_without_the_projectors_tokens_is_refused(default_model_path: Path, idefics3: Path):
    """SmolLM2-135M-Instruct lacks SmolVLM's image tokens: libmtmd would frame images with token -1."""
    with Model(default_model_path) as model, mtmd.Projector(model, idefics3, warmup=False) as projector:
        with mtmd.Bitmap.from_bytes(image_bytes(16, 16, seed=0)) as bitmap:
            with pytest.raises(mtmd.TokenizeError, match="does not have"):
                projector.tokenize(MARKER, [bitmap])
        projector.close()
        projector.close()
        assert projector._ptr == ffi.NULL
