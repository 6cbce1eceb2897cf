"""skippyctl generate: stream a generation from the head."""

from __future__ import annotations

import base64
import enum
import json
import sys
from pathlib import Path
from typing import Annotated

import trio
import typer

from skippyctl.client import ControlError, open_control
from skippyctl.render import EXIT_USAGE, fail, waiting_line
from skippyd.control import messages as m
from skippyd.sampling import InvalidSampling, SamplingParams

_SAMPLING = SamplingParams()  # the defaults of every surface


class Speculate(enum.StrEnum):
    """--speculate's values (skippyd's runtime.speculate)."""

    off = "off"
    ngram = "ngram"
    on = "on"


def generate(
    ctx: typer.Context,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt (the user message unless --raw).")],
    system: Annotated[str | None, typer.Option("--system", help="A system message.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="0 = greedy.")] = _SAMPLING.temperature,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = off.")] = _SAMPLING.top_k,
    top_p: Annotated[float, typer.Option("--top-p", help="1 = off.")] = _SAMPLING.top_p,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed (reproducible runs).")] = _SAMPLING.seed,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Go on past the model's end of generation: the reply runs to --max-tokens.")] = False,
    json_mode: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] = False,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="Constrain the reply to JSON valid against the JSON schema in FILE.",
        metavar="FILE")] = None,
    json_object: Annotated[bool, typer.Option("--json-object", help="Constrain the reply to a JSON object.")] = False,
    grammar: Annotated[Path | None, typer.Option(
        "--grammar", help="Constrain the reply to the grammar in FILE (GBNF, or Lark as llguidance reads it).",
        metavar="FILE")] = None,
    logprobs: Annotated[int | None, typer.Option(
        "--logprobs", min=0, max=20, help="Each token's logprob and its N most likely alternatives' (0-20).",
        metavar="N")] = None,
    speculate: Annotated[Speculate | None, typer.Option(
        "--speculate", help="ngram: draft tokens from the context and verify several per trip round the "
        "pipeline (the output is the same; on is the same); off: token by token. Default: the daemon's setting.",
        case_sensitive=False)] = None,
    images: Annotated[list[Path] | None, typer.Option(
        "--image", help="An image (PNG, JPEG, ...) for a head started with --mmproj (repeatable). The images go "
        "before the prompt's text, unless the prompt has one media marker (<__media__>) per image.",
        metavar="FILE")] = None,
) -> None:
    """Generate a reply; text streams to the terminal. Ctrl-C cancels it on the daemon."""
    g = ctx.obj
    printed = False  # whether streamed text is on the terminal (then errors start on a new line)
    files = {}
    for flag, path in (("--json-schema", json_schema), ("--grammar", grammar)):
        if path is not None:
            try:
                files[flag] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                fail(f"{flag}: cannot read {path}: {exc}", EXIT_USAGE)
    encoded = []
    for path in images or ():
        try:
            encoded.append(base64.b64encode(path.read_bytes()).decode("ascii"))
        except OSError as exc:
            fail(f"--image: cannot read {path}: {exc.strerror or exc}", EXIT_USAGE)
    try:  # the message's own checks (e.g. float32 ranges, a schema or grammar that compiles), before anything is sent
        request = m.Generate(id="1", prompt=prompt, system=system, raw=raw, max_tokens=max_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop=list(stop or []),
                             stream=not json_mode, json_schema=files.get("--json-schema"), json_object=json_object,
                             grammar=files.get("--grammar"), logprobs=logprobs,
                             speculate=None if speculate is None else speculate is not Speculate.off,
                             ignore_eos=ignore_eos, images=encoded)
        request.sampling()
    except (m.Invalid, InvalidSampling) as exc:
        fail(f"--{(exc.field or 'value').replace('_', '-')}: {exc}", EXIT_USAGE)

    async def go() -> dict:
        nonlocal printed
        async with open_control(g.url, g.token_file) as client:
            with waiting_line("reading the prompt, then the first token") as first_token:
                async for reply in client.replies(request):
                    if isinstance(reply, m.Piece):
                        first_token()
                        sys.stdout.write(reply.text)
                        sys.stdout.flush()
                        printed = True
                    elif isinstance(reply, m.Error):
                        raise ControlError(reply.message, code=reply.code)
                    elif isinstance(reply, m.Result):
                        return reply.result
        raise ControlError("the daemon ended the generation without a result")

    try:
        result = trio.run(go)
    except ControlError as exc:
        if printed:
            sys.stdout.write("\n")
        fail(str(exc), EXIT_USAGE if exc.code == "bad_request" else 1)
    except KeyboardInterrupt:
        # closing the connection cancels the generation on the daemon
        if printed:
            sys.stdout.write("\n")
            sys.stdout.flush()
        sys.stderr.write("cancelled\n")
        raise typer.Exit(130) from None
    if json_mode:
        keep = ("text", "tokens", "finish_reason", "usage", "timings", "session_id", "request_id", "logprobs")
        sys.stdout.write(json.dumps({k: result[k] for k in keep if k in result}) + "\n")
    else:
        sys.stdout.write("\n")
        for entry in result.get("logprobs") or ():  # token id, logprob, then the alternatives'
            alternatives = " ".join(f"{t}:{_num(lp)}" for t, lp in entry["top"])
            sys.stderr.write(f"{entry['token']}\t{_num(entry['logprob'])}\t{alternatives}\n")
        t = result["timings"]
        usage = result["usage"]
        # cached: prompt tokens no stage computed; then, on a pipeline, what each stage held rather than computed
        cached = f", cached {usage['cached_tokens']}" if "cached_tokens" in usage else ""
        stages = usage.get("prefix_cache") or ()
        if len(stages) > 1:  # in stage order
            cached += ", stages held " + "/".join(str(s["cached_tokens"]) for s in stages)
        sys.stderr.write(f"[{result['finish_reason']}: {usage['prompt_tokens']} prompt + "
                         f"{usage['completion_tokens']} generated tokens{cached}, ttft {t['ttft_ms']:.0f} ms, "
                         f"{t['decode_tokens_per_s']:.1f} tok/s"
                         + (f", images encoded in {t['image_encode_ms']:.0f} ms" if t.get("image_encode_ms") else "")
                         + "]\n")
    sys.stdout.flush()
    if result["finish_reason"] in ("cancelled", "error"):
        # killed on the daemon (skippyctl sessions kill, or a shutdown past its grace period)
        fail(f"the generation ended early: {result['finish_reason']}" +
             (f" ({result['error']})" if result.get("error") else ""))


def _num(x: float | None) -> str:
    return "-inf" if x is None else f"{x:.4f}"
