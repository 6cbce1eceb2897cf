"""An image prompt on the head without a daemon: its pieces, positions and cache keys, the limits an image is
held to before it is decoded, the chat template's image parts, an OpenAI message's content parts, and media rows
in a stage's batches."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from skippyd.head.errors import ImageRefused
from skippyd.head.images import ImageInput, ImageLimits, image_prompt
from skippyd.head.prompt import ImagePiece, Prompt, TextPiece, image_keys
from skippyd.openai import schemas
from skippyd.runtime import mtmd
from skippyd.runtime.chat_template import ChatTemplate, render_chat
from skippyd.runtime.llama import Model
from skippyd.stage.batching import BatchPolicy
from skippyd.wire.messages import NO_TOKEN
from tests.mm_models import claimed_size, image_bytes, write_idefics3_projector, write_smolvlm_text_model

MARKER = "<__media__>"


class FakeImage:
    """An image chunk's shape without libmtmd: `n_rows` rows taking `n_pos` positions (M-RoPE: a grid)."""

    def __init__(self, id: str, n_rows: int, grid: tuple[int, int] | None = None, non_causal: bool = False):
        self.id, self.n_tokens, self.grid, self.non_causal = id, n_rows, grid, non_causal
        self.n_pos = max(grid) if grid else n_rows
        self.closed = False

    def positions(self, start: int) -> np.ndarray:
        return mtmd.image_positions(start, self.n_tokens, self.grid)

    def encode(self) -> np.ndarray:
        return np.full((self.n_tokens, 8), 0.5, dtype=np.float32)

    def close(self) -> None:
        self.closed = True


def _text(*tokens: int):
    return SimpleNamespace(tokens=np.array(tokens, dtype=np.int32))


# --------------------------------------------------------------------------- the prompt


def test_a_prompt_with_an_mrope_image_has_fewer_positions_than_rows():
    image = FakeImage("a" * 64, 12, grid=(4, 3))
    prompt = Prompt.of_chunks([_text(1, 2, 3), image, _text(4, 5)])
    text, img, tail = prompt.pieces
    assert (text.start, img.start, img.end, tail.start) == (0, 3, 7, 7)
    assert prompt.n_pos == 9 and prompt.n_rows == 17 and prompt.image_rows == 12
    # a text position's key is its token; an image's are negative, from its id and place
    assert prompt.keys[:3].tolist() == [1, 2, 3] and prompt.keys[7:].tolist() == [4, 5]
    assert len(prompt.keys) == prompt.n_pos and (prompt.keys[3:7] < 0).all()
    assert prompt.text_tokens.tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="no list of tokens"):
        prompt.tokens  # noqa: B018
    prompt.close()
    assert image.closed


def test_a_restore_never_ends_inside_an_image():
    prompt = Prompt.of_chunks([_text(*range(10, 30)), FakeImage("b" * 64, 16), _text(7, 8, 9)])
    # positions 20..36 are the image's rows: a hit that ends among them restores up to its start
    assert [prompt.resume_point(n) for n in (5, 20, 21, 35, 36, 38, 99)] == [5, 20, 20, 20, 36, 38, 39]
    assert prompt.rows_before(20) == 20 and prompt.rows_before(36) == 36 and prompt.rows_before(38) == 38
    mrope = Prompt.of_chunks([_text(1, 2), FakeImage("c" * 64, 6, grid=(3, 2)), _text(3)])
    assert mrope.resume_point(3) == 2 and mrope.resume_point(5) == 5 and mrope.rows_before(5) == 8


def test_image_keys_are_the_images_and_the_tiles_own():
    a0, a1, b0 = image_keys("a" * 64, 0, 4), image_keys("a" * 64, 1, 4), image_keys("b" * 64, 0, 4)
    assert a0.dtype == np.int32 and (a0 < 0).all()
    assert np.array_equal(a0, image_keys("a" * 64, 0, 4)) and not np.array_equal(a0, a1)
    assert not set(a0.tolist()) & set(b0.tolist())
    # tiles of one image share its id: each is keyed by its place among them
    one = Prompt.of_chunks([FakeImage("a" * 64, 4), _text(5), FakeImage("a" * 64, 4)])
    assert np.array_equal(one.keys[:4], a0) and np.array_equal(one.keys[5:], a1)


def test_parts_chunk_text_and_images_and_keep_a_non_causal_image_whole():
    prompt = Prompt.of_chunks([_text(*range(100, 110)), FakeImage("d" * 64, 7), FakeImage("e" * 64, 7, non_causal=True),
                               _text(1, 2, 3)])
    spans = [(type(p).__name__, lo, hi) for p, lo, hi in prompt.parts(0, 4)]
    assert spans == [("TextPiece", 0, 4), ("TextPiece", 4, 8), ("TextPiece", 8, 10), ("ImagePiece", 0, 4),
                     ("ImagePiece", 4, 7), ("ImagePiece", 0, 7), ("TextPiece", 0, 3)]
    assert [(lo, hi) for _, lo, hi in prompt.parts(6, 4)][:2] == [(6, 10), (0, 4)]  # from inside a text piece
    image = prompt.pieces[1]
    with pytest.raises(ValueError, match="encoded"):
        prompt.part(image, 0, 4)
    image.rows = image.chunk.encode()
    first, second = prompt.part(image, 0, 4), prompt.part(image, 4, 7)
    assert (first.pos_start, first.pos_end, second.pos_start, second.pos_end) == (10, 14, 14, 17)
    assert (first.tokens == NO_TOKEN).all() and first.rows.shape == (4, 8) and first.media.causal
    assert np.array_equal(np.concatenate([first.media.keys, second.media.keys]), image.keys)


def test_an_mrope_image_in_parts_takes_its_positions_with_its_last_rows():
    prompt = Prompt.of_chunks([_text(1, 2), FakeImage("f" * 64, 12, grid=(4, 3))])
    image = prompt.pieces[1]
    image.rows = image.chunk.encode()
    first, last = (prompt.part(image, lo, hi) for _, lo, hi in prompt.parts(2, 8))
    assert (first.pos_start, first.pos_end, len(first.media.keys)) == (2, 2, 0)
    assert (last.pos_start, last.pos_end, len(last.media.keys)) == (2, 6, 4)
    assert first.media.positions.shape == (4, 8) and (first.media.positions[0] == 2).all()
    assert last.media.positions[2].tolist() == [2, 3, 4, 5]  # the last row's columns


# --------------------------------------------------------------------------- limits and decoding


def test_images_over_the_limits_are_refused_before_they_are_decoded():
    limits = ImageLimits(max_bytes=4096, max_pixels=64 * 64)
    small = image_bytes(32, 32, seed=1)
    limits.check(ImageInput(small, "images[0]"))
    with pytest.raises(ImageRefused) as err:
        limits.check(ImageInput(small + bytes(4096), "images[1]"))
    assert err.value.status == 413 and err.value.source == "images[1]" and "4096" in str(err.value)
    # a bomb: its header claims 60000 x 50000 pixels over a few bytes; refused from the header
    with pytest.raises(ImageRefused) as err:
        limits.check(ImageInput(claimed_size(small, 60000, 50000), "messages[0].content[2]"))
    assert err.value.status == 413 and "60000 x 50000" in str(err.value)
    with pytest.raises(ImageRefused) as err:
        limits.check(ImageInput(b"GIF? no, some text", "images[2]"))
    assert err.value.status == 400 and "no image" in str(err.value) and err.value.source == "images[2]"


@pytest.fixture(scope="module")
def smolvlm(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("smolvlm-prompts")
    model = write_smolvlm_text_model(default_model_path, work / "smolvlm.gguf")
    projector = write_idefics3_projector(work / "mmproj.gguf")
    with Model(model) as m, mtmd.Projector(m, projector, warmup=False) as p:
        yield m, p


def test_an_image_prompt_is_decoded_and_cut_into_pieces(smolvlm):
    model, projector = smolvlm
    png, jpeg = image_bytes(40, 30, seed=2), image_bytes(30, 40, seed=3, fmt="JPEG")
    prompt = image_prompt(projector, f"A {MARKER} and {MARKER}.", [ImageInput(png, "a"), ImageInput(jpeg, "b")],
                          raw=True)
    try:
        assert len({p.chunk.id for p in prompt.images}) == 2 and prompt.n_pos == prompt.n_rows
        assert all(isinstance(p, TextPiece | ImagePiece) for p in prompt.pieces)
    finally:
        prompt.close()
    with pytest.raises(ImageRefused) as err:
        image_prompt(projector, MARKER, [ImageInput(b"\x89PNG\r\n\x1a\n" + bytes(40), "messages[1].content[0]")],
                     raw=False)
    assert err.value.status == 400 and err.value.source == "messages[1].content[0]"
    with pytest.raises(ImageRefused, match="2 image markers"):
        image_prompt(projector, MARKER * 2, [ImageInput(png, "a")], raw=False)


# --------------------------------------------------------------------------- the chat template

SMOLVLM_TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
                    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
                    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
                    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
                    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
QWEN2VL_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
                    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}"
                    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
                    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize(("template", "image_text"), [
    (SMOLVLM_TEMPLATE, "<image>"), (QWEN2VL_TEMPLATE, "<|vision_start|><|image_pad|><|vision_end|>")])
def test_the_marker_goes_where_the_template_puts_an_image(smolvlm, template, image_text):
    model, _ = smolvlm
    assert ChatTemplate(template).image_text == image_text
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"},
                                         {"type": "image"}]}]
    text = render_chat(model, chat, template_source=template, media_marker=MARKER)
    assert text.count(MARKER) == 2 and image_text not in text and "What is this?" in text
    assert text == ChatTemplate(template).render(chat).replace(image_text, MARKER)


def test_a_template_for_text_gets_the_parts_joined_with_the_marker(smolvlm):
    model, _ = smolvlm  # SmolLM2's own template: string content only
    assert ChatTemplate(model.chat_template).image_text == ""
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]}]
    assert render_chat(model, chat, media_marker=MARKER) == render_chat(model, [{"role": "user",
                                                                                 "content": f"Look: {MARKER}"}])


# --------------------------------------------------------------------------- OpenAI content parts


def _chat_request(content, role: str = "user"):
    body = json.dumps({"model": "m", "messages": [{"role": role, "content": content}]}).encode()
    return schemas.parse(body, schemas.ChatCompletionRequest)


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_image_parts_become_the_generations_images_in_order():
    png, jpeg = image_bytes(8, 8, seed=1), image_bytes(8, 8, seed=2, fmt="JPEG")
    req = _chat_request([{"type": "text", "text": "Compare "},
                         {"type": "image_url", "image_url": {"url": _data_url(png)}}, {"type": "text", "text": " and "},
                         {"type": "image_url", "image_url": {"url": _data_url(jpeg, "image/jpeg"), "detail": "low"}}])
    greq = req.to_generation(1000, 512)
    assert [i.data for i in greq.images] == [png, jpeg]
    assert [i.source for i in greq.images] == ["messages[0].content[1]", "messages[0].content[3]"]
    assert greq.messages[0]["content"] == [{"type": "text", "text": "Compare "}, {"type": "image"},
                                           {"type": "text", "text": " and "}, {"type": "image"}]
    plain = _chat_request([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]).to_generation(1000, 512)
    assert plain.messages[0]["content"] == "ab" and plain.images == ()


@pytest.mark.parametrize(("part", "role", "param", "words"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "user",
     "messages[0].content[0].image_url.url", "fetches nothing from the network"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "user",
     "messages[0].content[0].image_url.url", "base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,***"}}, "user",
     "messages[0].content[0].image_url.url", "not valid base64"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "system", "messages[0].content[0]",
     "user messages"),
    ({"type": "input_audio", "input_audio": {}}, "user", "messages[0].content[0].type", "not supported"),
])
def test_image_parts_that_cannot_be_served_are_refused_naming_the_part(part, role, param, words):
    with pytest.raises(schemas.BadParameter) as err:
        _chat_request([part], role=role).to_generation(1000, 512)
    assert err.value.param == param and words in str(err.value)


# --------------------------------------------------------------------------- a stage's batches


def test_media_rows_go_alone_first_and_are_not_decode_steps():
    policy = BatchPolicy(max_batch_tokens=64)
    step = SimpleNamespace(seq=0, n=1, window=False, solo=False)
    chunk = SimpleNamespace(seq=1, n=8, window=False, solo=False)
    one_row_image = SimpleNamespace(seq=2, n=1, window=False, solo=True)
    assert policy.take([step, chunk, one_row_image]) == [one_row_image]
    assert policy.take([step, chunk]) == [step, chunk]


def test_media_rows_compute_at_their_positions_with_causal_attention_as_they_say(tiny_model_small_vocab_path: Path):
    """A stage's compute of a solo job: input embeddings on a first stage, the given positions, causal attention
    off where the rows say so: what the context computes for the same rows directly."""
    from skippyd.runtime.llama import Context, ContextParams
    from skippyd.stage.execution import Execution, HotPath, Job, SchedulerStats
    from skippyd.stage.threads import ThreadChooser

    params = ContextParams(n_ctx_per_seq=64, n_seq_max=1, n_batch=64, n_ubatch=64, n_threads=1)
    with Model(tiny_model_small_vocab_path) as model, Context(model, params) as ours, Context(model, params) as theirs:
        execution = Execution(ours, threads=ThreadChooser(1, enabled=False), stats=SchedulerStats(),
                              hot_path=HotPath())
        embd = np.random.default_rng(0).standard_normal((5, model.n_embd_inp), dtype=np.float32)
        pos = np.arange(3, 8, dtype=np.int32)
        logits = {}
        for causal in (True, False):
            for ctx in (ours, theirs):
                ctx.kv_clear_seq(0)
            job = Job(0, 3, tokens=None, embd=embd, want_token=True, positions=pos.reshape(1, 5), causal=causal)
            assert job.solo
            execution.compute_sync([job])
            theirs.decode(pos, np.zeros(5, np.int32), input_embd=embd, causal=causal)
            np.testing.assert_array_equal(ours.logits(0), theirs.logits(0))
            assert ours.kv_pos_range(0) == (3, 7)
            logits[causal] = ours.logits(0)
        assert not np.allclose(logits[True], logits[False])
