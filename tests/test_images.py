"""Images through skippyd: real processes on loopback, 1, 2 and 3 stages, the official openai client.

Two fixtures (tests/mm_models.py): SmolVLM's projector type (idefics3) on the default model given SmolVLM's image
tokens, and a small Qwen2-VL (M-RoPE: an image's rows take four positions each, fewer positions than rows). Greedy
tokens of prompts with images before, inside and after the text, and two images, equal llama.cpp's own
multimodal path (llama-cpp-python's mtmd bindings over the same build) on every deployment. Then what a client
can get wrong (each a 4xx, the daemon serving on), cancellation while an image encodes or its rows go through
the pipeline, the prefix cache with images, the projector refused at start, and deploy --mmproj.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import trio

from skippyctl.client import call_once, open_control
from skippyd.control import messages as m
from skippyd.runtime.slicing import split_model
from tests.llama_cpp_reference import install_llama_cpp, mtmd_greedy_tokens
from tests.mm_models import (
    claimed_size,
    image_bytes,
    write_idefics3_projector,
    write_qwen2vl_projector,
    write_qwen2vl_text_model,
    write_smolvlm_text_model,
)
from tests.openai_api import Api, wait_healthy
from tests.procs import Daemon, Pipeline, SingleStage, free_ports, retarget

pytestmark = pytest.mark.slow

N_TOKENS = 12
MARKER = "<__media__>"
# SmolLM2's chat template (both fixtures' tokenizer) for one user message: its default system prompt, ChatML
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def chat_text(user: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


# prompt -> (the text sent, the images' (width, height, seed, format), the user message as the head renders it)
PROMPTS = {
    "image before the text": ("Describe the picture.", [(48, 40, 1, "PNG")], f"{MARKER}Describe the picture."),
    "image inside the text": (f"What is in {MARKER} and why?", [(64, 24, 2, "JPEG")], None),
    "image after the text": (f"Here is the picture: {MARKER}", [(30, 30, 3, "PNG")], None),
    "two images": (f"Compare {MARKER} with {MARKER}, please.", [(40, 56, 4, "JPEG"), (56, 40, 5, "PNG")], None),
}
# Qwen2-VL keeps an image's size: 192 x 128 pixels are 24 x 16 rows (384, in two prefill chunks of 256)
QWEN_LARGE = {"a large image in two chunks": (f"Read {MARKER} twice", [(192, 128, 6, "PNG")], None)}


def _images(specs) -> list[bytes]:
    return [image_bytes(w, h, seed=seed, fmt=fmt) for w, h, seed, fmt in specs]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def models(default_model_path: Path, small_tokenizer_fields, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each fixture's text model and projector."""
    work = tmp_path_factory.mktemp("image-models")
    return {
        "idefics3": (write_smolvlm_text_model(default_model_path, work / "smolvlm-text.gguf"),
                     write_idefics3_projector(work / "mmproj-idefics3.gguf")),
        "qwen2vl": (write_qwen2vl_text_model(work / "qwen2vl.gguf", small_tokenizer_fields),
                    write_qwen2vl_projector(work / "mmproj-qwen2vl.gguf")),
    }


@pytest.fixture(scope="module")
def splits(models, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """(fixture, stages) -> the split's topology.toml (2 and 3 stages)."""
    out = {}
    for name, (model, _) in models.items():
        for n in (2, 3):
            folder = tmp_path_factory.mktemp(f"{name}-split{n}")
            split_model(model, None, folder, stages=n)
            out[name, n] = folder / "topology.toml"
    return out


def _start(models, splits, work: Path, name: str, n: int, *, extra: tuple[str, ...] = (),
           config: dict | None = None) -> Pipeline:
    """A deployment of fixture `name` on `n` stages (not yet waited for), its head given the projector."""
    model, projector = models[name]
    flags = ["--mmproj", str(projector), "--ctx", "2048", *extra]
    if n == 1:
        return SingleStage(model, work, flags, config=config, wait=False, name=f"{name}-single")
    folder = work / f"{name}-{n}"
    folder.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline(retarget(splits[name, n], folder), folder, extra=flags, config=config)
    for k in reversed(range(n)):
        pipe.start_stage(k, wait=False)
    return pipe


def _wait(pipes) -> None:
    try:
        for pipe in pipes:
            for d in pipe.stages.values():
                d.wait_ready(120)
    except BaseException:
        for pipe in pipes:
            pipe.stop()
        raise


@pytest.fixture(scope="module")
def deployments(models, splits, tmp_path_factory):
    """Every fixture on 1, 2 and 3 stages, started at once."""
    work = tmp_path_factory.mktemp("image-deployments")
    pipes = {(name, n): _start(models, splits, work, name, n) for name in models for n in (1, 2, 3)}
    _wait(pipes.values())
    yield pipes
    for pipe in pipes.values():
        pipe.stop_cleanly()


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory):
    return install_llama_cpp(tmp_path_factory.mktemp("llama-cpp-python"))


def _generate(pipe: Pipeline, prompt: str, images: list[bytes], **kw) -> dict:
    head = pipe.stages[0]
    return call_once(head.url, head.token_file, lambda i: m.Generate(
        id=i, prompt=prompt, images=[b64(x) for x in images], max_tokens=N_TOKENS, stream=False, **kw))


@pytest.fixture(scope="module")
def results(models, deployments, llama_cpp) -> dict[tuple[str, str], dict[str, list[int]]]:
    """(fixture, prompt) -> the greedy tokens of 1, 2 and 3 stages and of llama-cpp-python."""
    out = {}
    for name, (model, projector) in models.items():
        prompts = {**PROMPTS, **(QWEN_LARGE if name == "qwen2vl" else {})}
        for label, (prompt, specs, rendered) in prompts.items():
            images = _images(specs)
            got = {f"{n} stages": _generate(deployments[name, n], prompt, images) for n in (1, 2, 3)}
            row = {key: r["tokens"] for key, r in got.items()}
            row["usage"] = [r["usage"]["prompt_tokens"] for r in got.values()]
            row["encode_ms"] = [r["timings"]["image_encode_ms"] for r in got.values()]
            # the head's prefill chunk (256) as llama.cpp's batch: the same batches, the same rounding
            row["llama-cpp-python"] = mtmd_greedy_tokens(llama_cpp, model, projector, chat_text(rendered or prompt),
                                                         images, N_TOKENS, n_batch=256, add_special=False)
            out[name, label] = row
    return out


# --------------------------------------------------------------------------- parity


# a large image split over prefill chunks: Qwen2-VL's (SmolVLM's tiles are 4 rows each)
CASES = [(fixture, label) for fixture in ("idefics3", "qwen2vl") for label in PROMPTS] + \
    [("qwen2vl", label) for label in QWEN_LARGE]


@pytest.mark.parametrize(("fixture", "label"), CASES)
def test_image_prompts_give_llama_cpps_tokens_on_1_2_and_3_stages(results, fixture, label):
    row = results[fixture, label]
    reference = row["llama-cpp-python"]
    assert len(reference) >= 4
    for n in (1, 2, 3):
        assert row[f"{n} stages"] == reference, f"{n} stages"
    assert len(set(row["usage"])) == 1 and all(ms > 0 for ms in row["encode_ms"])


def test_the_image_decides_the_reply(deployments):
    prompt, specs, _ = PROMPTS["image inside the text"]
    (w, h, seed, fmt), = specs
    replies = {tuple(_generate(deployments["idefics3", 2], prompt, [image_bytes(w, h, seed=s, fmt=fmt)])["tokens"])
               for s in (seed, seed + 100)}
    assert len(replies) == 2


# --------------------------------------------------------------------------- the OpenAI endpoint


@pytest.fixture(scope="module")
def served(models, splits, tmp_path_factory, tiny_model_small_vocab_path):
    """The idefics3 fixture on 2 stages serving the OpenAI API (its prefix cache on, images of 1 MiB and a
    million pixels at most, 512 positions per session), and a head without a projector."""
    work = tmp_path_factory.mktemp("image-api")
    port, plain_port = free_ports(2)
    pipe = _start(models, splits, work, "idefics3", 2,
                  extra=("--openai", f"127.0.0.1:{port}", "--prefix-cache-mb", "64", "--ctx", "512"),
                  config={"runtime.image_max_mb": 1, "runtime.image_max_pixels": 1_000_000})
    plain = SingleStage(tiny_model_small_vocab_path, work, ["--openai", f"127.0.0.1:{plain_port}"], wait=False,
                        name="no-projector")
    _wait([pipe, plain])
    api, plain_api = Api(pipe, port), Api(plain, plain_port)
    wait_healthy(api)
    wait_healthy(plain_api)
    yield api, plain_api
    pipe.stop_cleanly()
    plain.stop_cleanly()


def _image_chat(api: Api, *parts, stream: bool = False, model: str | None = None, **kw):
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith(("data:", "https:")) else
               {"type": "text", "text": p} for p in parts]
    return api.client.chat.completions.create(
        model=model or api.client.models.list().data[0].id, messages=[{"role": "user", "content": content}],
        temperature=0, max_tokens=N_TOKENS, stream=stream, **kw)


def test_the_openai_client_sends_images_as_data_urls_streaming_and_not(served, results):
    api, _ = served
    png = _images(PROMPTS["image before the text"][1])[0]
    whole = _image_chat(api, data_url(png), "Describe the picture.")
    streamed = _image_chat(api, data_url(png), "Describe the picture.", stream=True,
                           stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == text and text
    # the same prompt through the control channel gave llama.cpp's tokens; here, its text (image tokens counted)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == whole.usage.prompt_tokens == results["idefics3", "image before the text"]["usage"][0]
    two = _image_chat(api, "Compare ", data_url(png), " with ",
                      data_url(image_bytes(40, 56, seed=4, fmt="JPEG"), "image/jpeg"), ", please.")
    assert two.choices[0].message.content and two.usage.prompt_tokens > whole.usage.prompt_tokens


def _status_of(call) -> tuple[int, dict]:
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body if isinstance(exc.body, dict) else {}
    raise AssertionError("the request succeeded")


def test_bad_images_are_refused_each_with_its_status_and_the_daemon_serves_on(served):
    api, plain = served
    png = image_bytes(48, 40, seed=7)
    cases = {
        "no projector": (lambda: _image_chat(plain, data_url(png), "What?"), 400, "start the head with --mmproj"),
        "a web address": (lambda: _image_chat(api, "https://example.com/cat.png", "What?"), 400, "network"),
        "not an image": (lambda: _image_chat(api, "What?", data_url(b"\x89PNG but no, just text")), 400,
                         "messages[0].content[1]"),
        "too many bytes": (lambda: _image_chat(api, data_url(png + bytes(1 << 20)), "What?"), 413, "image_max_mb"),
        "too many pixels": (lambda: _image_chat(api, data_url(claimed_size(png, 40000, 40000)), "What?"), 413,
                            "40000 x 40000"),
        "more than the context holds": (lambda: _image_chat(api, *[data_url(png)] * 30, "What?"), 400, "tokens"),
    }
    for name, (call, status, words) in cases.items():
        got, body = _status_of(call)
        message = json.dumps(body)
        assert got == status and words in message, (name, got, message)
    for client in (api, plain):
        assert client.client.chat.completions.create(
            model=client.client.models.list().data[0].id, messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2).choices[0].message.content is not None
    assert _image_chat(api, data_url(png), "What is it?").choices[0].message.content


def test_the_model_says_it_takes_images(served):
    api, plain = served
    with api.http() as h:
        model = h.get("/v1/models").json()["data"][0]
    assert model["input_modalities"] == ["text", "image"]
    assert model["vision"]["projector_type"] == "idefics3" and model["vision"]["tokens_per_image"] > 0
    with plain.http() as h:
        assert h.get("/v1/models").json()["data"][0]["input_modalities"] == ["text"]
    status = api.pipe.head.status()
    assert status["head"]["vision"]["projector"] == "mmproj-idefics3.gguf"
    proc = subprocess.run([sys.executable, "-m", "skippyctl.app", "--url", api.pipe.head.url, "--token-file",
                           str(api.pipe.head.token_file), "status"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "images: mmproj-idefics3.gguf (idefics3)" in proc.stdout, proc.stdout


def test_a_second_question_about_the_same_image_reuses_its_kv_and_another_image_none(served, models):
    api, _ = served
    picture, other = image_bytes(50, 44, seed=21), image_bytes(50, 44, seed=22)
    first = _image_chat(api, data_url(picture), "What is in this picture?")
    again = _image_chat(api, data_url(picture), "Which colours are in it?")
    another = _image_chat(api, data_url(other), "Which colours are in it?")
    before_image = _tokens_before_marker(models["idefics3"][0])
    # at most the text before the picture, which other requests had (and the tokens framing its first tile)
    assert first.usage.prompt_tokens_details.cached_tokens <= before_image + 3
    # the picture's 5 tiles of 4 rows each (a 2x2 grid and the whole), and more
    assert again.usage.prompt_tokens_details.cached_tokens >= before_image + 20
    # the other picture: at most the text before it
    assert another.usage.prompt_tokens_details.cached_tokens <= before_image + 3


def _tokens_before_marker(model: Path) -> int:
    from skippyd.runtime.llama import Model

    with Model(model) as m:
        return len(m.tokenize(chat_text("")[:chat_text("").index("<|im_end|>\n<|im_start|>assistant")],
                              add_special=False, parse_special=True))


# --------------------------------------------------------------------------- cancellation


@pytest.fixture(scope="module")
def slow_link(models, splits, tmp_path_factory) -> Pipeline:
    """Qwen2-VL on 2 stages, each message from the head delayed 100 ms: an image's rows take a while to go
    through."""
    pipe = _start(models, splits, tmp_path_factory.mktemp("image-cancel"), "qwen2vl", 2, extra=("--ctx", "4096"),
                  config={"stage.link_delay_ms": 100})
    _wait([pipe])
    yield pipe
    pipe.stop_cleanly()


BIG = [image_bytes(256, 256, seed=s) for s in (31, 32, 33)]  # 1024 rows each, a few hundred ms to encode


async def _until_state(pipe: Pipeline, wanted, timeout: float = 30.0) -> dict:
    """Poll the head's sessions until one matches `wanted`; that session."""
    head = pipe.stages[0]
    async with open_control(head.url, head.token_file) as client:
        with trio.fail_after(timeout):
            while True:
                for s in await client.call(m.SessionsList(id=client.new_id())):
                    if wanted(s):
                        return s
                await trio.sleep(0.005)


async def test_a_generation_killed_while_its_image_encodes_leaves_no_session(slow_link):
    head = slow_link.stages[0]
    result = {}

    async def generate():
        async with open_control(head.url, head.token_file) as client:
            result.update(await client.call(m.Generate(id=client.new_id(), prompt=f"{MARKER}{MARKER}{MARKER}",
                                                       raw=True, images=[b64(x) for x in BIG], max_tokens=4,
                                                       stream=False)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        session = await _until_state(slow_link, lambda s: s["state"] == "encode")
        async with open_control(head.url, head.token_file) as client:
            await client.call(m.SessionKill(id=client.new_id(), session_id=session["session_id"], wait=True))
    assert result["finish_reason"] == "cancelled"
    await slow_link.wait_all_released(timeout=10)


async def test_a_client_gone_while_an_images_rows_go_through_leaves_no_session(slow_link):
    head = slow_link.stages[0]

    async def generate():
        async with open_control(head.url, head.token_file) as client:
            await client.call(m.Generate(id=client.new_id(), prompt=f"{MARKER} and {MARKER}", raw=True,
                                         images=[b64(x) for x in BIG[:2]], max_tokens=4, stream=True))

    encoded = False

    def rows_going_through(session: dict) -> bool:
        """An image encoded, its rows (in 4 prefill chunks of 256) going to stage 1."""
        nonlocal encoded
        encoded = encoded or session["state"] == "encode"
        return encoded and session["state"] == "prefill"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        await _until_state(slow_link, rows_going_through)
        nursery.cancel_scope.cancel()  # the connection closes: the daemon cancels its generations
    await slow_link.wait_all_released(timeout=10)


# --------------------------------------------------------------------------- start and deploy


@pytest.mark.parametrize("case", ["another width", "not a projector", "a text model without its tokens"])
def test_a_projector_that_does_not_fit_stops_the_daemon_with_one_line(case, models, default_model_path, tmp_path):
    model, projector = models["idefics3"]
    if case == "another width":
        projector = write_idefics3_projector(tmp_path / "mmproj-640.gguf", n_embd_text=640)
        words = ["640", "576", "mmproj-640.gguf"]
    elif case == "not a projector":
        projector, words = model, [str(model), "not a multimodal projector"]
    else:
        model, words = default_model_path, ["does not have"]
    proc = subprocess.run([sys.executable, "-m", "skippyd.daemon", "--model", str(model), "--mmproj", str(projector),
                           "--no-control"], capture_output=True, text=True, timeout=120)
    fatal = [line for line in proc.stderr.splitlines() if "fatal" in line]
    assert proc.returncode == 1 and len(fatal) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(w in fatal[0] for w in words), fatal


def test_deploy_sends_the_projector_to_the_heads_host(models, results, tmp_path):
    from skippyd.control.token import load_or_create_token
    from tests.test_deploy_host import _skippyctl, _two_free_ports

    model, projector = models["idefics3"]
    token = load_or_create_token(tmp_path / "seed.token")
    for k in range(2):
        (tmp_path / f"host{k}.token").write_text(token + "\n")
    daemons = [Daemon(["--slices-dir", str(tmp_path / f"slices{k}"), "--lanes", "2", "--ctx", "2048"], tmp_path,
                      f"host{k}") for k in range(2)]
    try:
        for d in daemons:
            d.wait_ready()
        names = ",".join(f"127.0.0.1:{d.control_port}" for d in daemons)
        args = ["deploy", str(model), "--mmproj", str(projector), "--hosts", names, "--ranges", "0:15,15:30",
                "--stage-port", str(_two_free_ports())]
        deployed = _skippyctl(tmp_path, tmp_path / "seed.token", *args)
        assert deployed["bytes_sent"] > projector.stat().st_size
        prompt, specs, _ = PROMPTS["image inside the text"]
        head = daemons[0]
        got = call_once(head.url, head.token_file, lambda i: m.Generate(
            id=i, prompt=prompt, images=[b64(x) for x in _images(specs)], max_tokens=N_TOKENS, stream=False))
        assert got["tokens"] == results["idefics3", "image inside the text"]["llama-cpp-python"]
        assert _skippyctl(tmp_path, tmp_path / "seed.token", *args)["bytes_sent"] == 0  # held: nothing sent again
    finally:
        for d in daemons:
            assert d.stop() == 0, d.log()


# --------------------------------------------------------------------------- resume


async def test_a_stage_killed_after_an_image_prompt_resumes_with_the_same_tokens(models, splits, tmp_path):
    """--resume replays the prompt, its image's rows (kept on the head since their encode) at their positions,
    and the tokens so far; the generation ends with an uninterrupted run's tokens."""
    from tests.test_resume import check_resumed

    pipe = _start(models, splits, tmp_path, "qwen2vl", 2, extra=("--resume",),
                  config={"runtime.resume_window": 30, "runtime.compute_lock": "off"})
    await trio.to_thread.run_sync(_wait, [pipe])
    try:
        prompt, specs, _ = QWEN_LARGE["a large image in two chunks"]
        kw = dict(prompt=prompt, images=[b64(x) for x in _images(specs)], max_tokens=48)
        await check_resumed(pipe, 1, kw, when="decode")
    finally:
        await trio.to_thread.run_sync(pipe.stop)
