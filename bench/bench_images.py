"""Images: the projector's encode time and the time to first token of an image prompt, one stage against two.

    .venv/bin/python bench/bench_images.py [--rounds 3] [--json bench/results/images.json]

The model is the default one (SmolLM2-135M-Instruct, real weights) given SmolVLM's image tokens, and the
projector SmolVLM-256M's vision tower in shape (SigLIP: 512-pixel tiles of 16-pixel patches, 768 wide, 12
layers of 12 heads; a 4x pixel shuffle to 64 rows per tile) with random weights: the compute is the real
one's, the reply is not. An image of 640 x 480 pixels is resized to a longest side of 1024 and cut into 2 x 2
tiles and a global view: 5 tiles, 320 rows, and the framing tokens.

Both configurations are started at once (skippyd processes on loopback, ``--threads`` compute threads each,
the prefix cache and speculation off) and measured in interleaved rounds, each round one new image (the same
for both). Per request, from the result: the projector's encode time (``timings.image_encode_ms``) and the
time to first token (``timings.ttft_ms``, from the request's arrival at the head: decoding the image, its
chunks, the encode, the prefill through every stage and the first token), and the rest of it (the prefill and
the first token). Medians with the range over the rounds.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from skippyctl.client import open_control  # noqa: E402
from skippyd.control import messages as m  # noqa: E402
from skippyd.runtime.models import fetch_default_model  # noqa: E402
from skippyd.runtime.slicing import split_model  # noqa: E402
from tests.mm_models import image_bytes, write_idefics3_projector, write_smolvlm_text_model  # noqa: E402
from tests.procs import Pipeline, SingleStage, retarget  # noqa: E402

PROMPT = "Describe the picture."


async def one_request(pipe: Pipeline, image: bytes) -> dict:
    head = pipe.stages[0]
    async with open_control(head.url, head.token_file) as client:
        result = await client.call(m.Generate(id=client.new_id(), prompt=PROMPT,
                                              images=[base64.b64encode(image).decode()], max_tokens=4,
                                              stream=False))
    t = result["timings"]
    return {"encode_ms": t["image_encode_ms"], "ttft_ms": t["ttft_ms"],
            "rest_ms": t["ttft_ms"] - t["image_encode_ms"], "prompt_tokens": result["usage"]["prompt_tokens"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the measurements here")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="skippy-bench-images-") as tmp:
        tmp = Path(tmp)
        model = write_smolvlm_text_model(fetch_default_model(), tmp / "smolvlm-text.gguf")
        projector = write_idefics3_projector(tmp / "mmproj.gguf", image_size=512, patch_size=16, longest_edge=1024,
                                             scale_factor=4, n_embd=768, n_layer=12, n_head=12, n_ff=3072)
        split_model(model, None, tmp / "split", stages=2)
        common = ["--mmproj", str(projector), "--threads", str(args.threads), "--lanes", "2", "--ctx", "4096"]
        (tmp / "single").mkdir()
        configs = {"single": SingleStage(model, tmp / "single", common, wait=False)}
        work = tmp / "two"
        work.mkdir()
        two = Pipeline(retarget(tmp / "split" / "topology.toml", work), work, extra=common)
        for k in (1, 0):
            two.start_stage(k, wait=False)
        configs["2-stage"] = two
        try:
            for pipe in configs.values():
                for d in pipe.stages.values():
                    d.wait_ready(180)
            rows: dict[str, list[dict]] = {name: [] for name in configs}
            for r in range(args.rounds):
                image = image_bytes(640, 480, seed=100 + r, fmt="JPEG")
                for name, pipe in configs.items():
                    rows[name].append(trio.run(one_request, pipe, image))
                    print(f"round {r + 1} {name}: {rows[name][-1]}", file=sys.stderr)
        finally:
            for pipe in configs.values():
                pipe.stop()
    print(f"\n{args.rounds} rounds, {time.monotonic() - started:.0f} s; an image of 640x480 pixels, "
          f"{rows['single'][0]['prompt_tokens']} prompt tokens\n")
    print("| | encode ms | time to first token ms | first token less encode ms |")
    print("|---|---|---|---|")
    for name, got in rows.items():
        print(f"| {name} | {spread([g['encode_ms'] for g in got])} | {spread([g['ttft_ms'] for g in got])} | "
              f"{spread([g['rest_ms'] for g in got])} |")
    ratio = [b["ttft_ms"] / a["ttft_ms"] for a, b in zip(rows["single"], rows["2-stage"])]
    print(f"\ntime to first token, 2 stages / single: {statistics.median(ratio):.2f} "
          f"({min(ratio):.2f}-{max(ratio):.2f})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rounds": rows, "threads": args.threads}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
