"""Cut a GGUF model into stage files ("slices") by contiguous layer ranges.

A stage file for layers [a, b) is a complete GGUF model that the patched
libllama loads as is:

* every metadata key of the source, per-layer arrays whole, except
  `{arch}.block_count = b - a` (the loader reads the hyperparameters for the
  whole model, then keeps those of its absolute layers);
* `skippy.layer_start`, `skippy.layer_end`, `skippy.n_layer_total` (u32),
  `skippy.output` ("hidden" for non-final stages, which is what the patched
  libllama keys on, "logits" for the final one) and `skippy.source_sha256`;
* tensors `blk.{a..b-1}.*` renamed `blk.{0..b-a-1}.*`, byte for byte; every
  non-block tensor (the loader needs `token_embd` and `output_norm` even where
  they are unused); the LM head `output.weight` only on the final stage.

The source is parsed once (parsing a 49k-token vocabulary costs ~2 s) and all
stages are written from it. Each file is written under a temporary name and
renamed when complete, so a crash never leaves a half-written stage behind.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import gguf

from skippyd.runtime.architectures import support
from skippyd.runtime.gguf_info import (
    SKIPPY_LAYER_END,
    SKIPPY_LAYER_START,
    SKIPPY_N_LAYER_TOTAL,
    SKIPPY_OUTPUT,
    SKIPPY_SOURCE_SHA256,
    ModelFileError,
    field_length,
    field_value,
    open_gguf,
)
from skippyd.topology import (
    DEFAULT_BASE_PORT,
    DEFAULT_HOST,
    StageSpec,
    Topology,
    parse_address,
    stage_addresses,
)

Progress = Callable[[int, int], None]

TOPOLOGY_FILE = "topology.toml"

# Metadata that a stage cannot honour whatever its architecture (variants of architectures that split).
_UNSPLITTABLE_KEYS: dict[str, str] = {
    "nextn_predict_layers": "its next-token-prediction layers follow the main stack and read its last hidden state",
    "n_deepstack_layers": "deepstack inputs join the residual stream at layers that may be on another stage",
    "deepstack_mapping": "deepstack inputs join the residual stream at layers that may be on another stage",
    "embedding_length_per_layer_input": "per-layer token inputs travel beside the residual stream",
    "attention.shared_kv_layers": "later layers attend with the KV cache of earlier layers",
}

# Tensors only the final stage needs: the LM head (tied models have none and
# fall back to token_embd, which every stage carries anyway).
_FINAL_ONLY_TENSORS = frozenset({"output.weight", "output.bias"})
# The llama loader refuses a model without these, even on stages that never use them.
_REQUIRED_TENSORS = ("token_embd.weight", "output_norm.weight")

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_RANGE_RE = re.compile(r"^\s*(-?\d+)\s*:\s*(-?\d+)\s*$")


class SliceError(ValueError):
    """A model cannot be split as asked; the message says why."""


class RangeError(SliceError):
    """The requested stages or layer ranges are invalid (a usage error, not a model problem)."""


# --- planning --------------------------------------------------------------


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """Parse "0:10,10:20,20:30" into [(0, 10), (10, 20), (20, 30)] (not yet validated)."""
    if not text.strip():
        raise RangeError("no layer ranges given (expected START:END,..., e.g. 0:15,15:30)")
    ranges = []
    for part in text.split(","):
        m = _RANGE_RE.match(part)
        if not m:
            raise RangeError(f"bad layer range {part.strip()!r}: expected START:END, e.g. 0:15")
        ranges.append((int(m.group(1)), int(m.group(2))))
    return ranges


def plan_ranges(
    n_layer: int,
    stages: int | None = None,
    ranges: str | Sequence[tuple[int, int]] | None = None,
) -> list[tuple[int, int]]:
    """Layer ranges [start, end) for each stage, covering [0, n_layer) exactly.

    Give either `stages` (an even split; earlier stages get the extra layer
    when n_layer does not divide evenly) or explicit `ranges`, as a string
    "0:10,10:20,20:30" or a sequence of (start, end) pairs. Ranges must be
    non-empty, ascending and contiguous, start at 0 and end at n_layer.
    """
    if n_layer < 1:
        raise RangeError(f"the model has no layers to split (block_count {n_layer})")
    if (stages is None) == (ranges is None):
        raise RangeError("give either a number of stages or explicit layer ranges, not both or neither")
    if stages is not None:
        if stages < 1:
            raise RangeError(f"the number of stages must be at least 1, got {stages}")
        if stages > n_layer:
            raise RangeError(
                f"cannot split {n_layer} layers into {stages} stages: every stage needs at least one layer"
            )
        base, extra = divmod(n_layer, stages)
        out, start = [], 0
        for k in range(stages):
            end = start + base + (1 if k < extra else 0)
            out.append((start, end))
            start = end
        return out

    assert ranges is not None
    parsed = parse_ranges(ranges) if isinstance(ranges, str) else [(int(a), int(b)) for a, b in ranges]
    if not parsed:
        raise RangeError("no layer ranges given")
    expected_start = 0
    for start, end in parsed:
        label = f"{start}:{end}"
        if start < 0 or end < 0:
            raise RangeError(f"layer range {label} has a negative layer index")
        if end == start:
            raise RangeError(f"layer range {label} is empty: every stage needs at least one layer")
        if end < start:
            raise RangeError(f"layer range {label} is reversed: write START:END with START < END")
        if start != expected_start:
            what = "leave a gap" if start > expected_start else "overlap"
            if expected_start == 0:
                raise RangeError(f"layer ranges must start at layer 0, the first one is {label}")
            raise RangeError(
                f"layer range {label} does not start where the previous one ends ({expected_start}); "
                f"ranges must be contiguous and ascending, these {what}"
            )
        if end > n_layer:
            raise RangeError(
                f"layer range {label} goes past the last layer: the model has {n_layer} layers (0:{n_layer})"
            )
        expected_start = end
    if expected_start != n_layer:
        raise RangeError(
            f"layer ranges end at layer {expected_start} but the model has {n_layer} layers; "
            f"the last range must end at {n_layer}"
        )
    return parsed


BALANCE_MODES = ("layers", "compute")


def compute_costs(reader: gguf.GGUFReader, n_layer: int) -> tuple[list[int], int]:
    """What a decode step multiplies through, in weights: each layer's, and the LM head's.

    Counts the elements of every matrix (tensors of two or more dimensions;
    norms and biases are negligible): the multiply-adds per token. The LM
    head is ``output.weight``, or the token embedding of a model that ties
    them. On a small model the head weighs as much as several layers (the
    default model: 28 M against 3.5 M per layer).
    """
    layers = [0] * n_layer
    head = embd = 0
    for t in reader.tensors:
        if len(t.shape) < 2:
            continue
        n = int(t.n_elements)
        m = _BLOCK_RE.match(t.name)
        if m is not None:
            if int(m.group(1)) < n_layer:
                layers[int(m.group(1))] += n
        elif t.name == "output.weight":
            head = n
        elif t.name == "token_embd.weight":
            embd = n
    return layers, head or embd


def balanced_ranges(layer_costs: Sequence[int], head_cost: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ranges of at least one layer each whose largest stage cost is as small as it can be (the
    final stage's cost includes `head_cost`); of equally good splits, the one with the earliest boundaries.

    Exact (dynamic programming over boundaries): O(stages x layers^2), a fraction of a second for any real
    model."""
    n = len(layer_costs)
    plan_ranges(n, stages=stages)  # the checks of an even split: 1 <= stages <= layers
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)
    # best[i]: the smallest largest-stage cost of layers [0, i) cut into k stages; cut[k][i]: where the last began
    inf = float("inf")
    best = [inf] * (n + 1)
    best[0] = 0
    cut: list[list[int]] = []
    for k in range(1, stages):
        nxt, where = [inf] * (n + 1), [0] * (n + 1)
        for i in range(k, n - (stages - k) + 1):  # leave a layer for each stage after
            for j in range(k - 1, i):
                cost = max(best[j], prefix[i] - prefix[j])
                if cost < nxt[i]:
                    nxt[i], where[i] = cost, j
        best = nxt
        cut.append(where)
    final, start = inf, 0
    for j in range(stages - 1, n):
        cost = max(best[j], prefix[n] - prefix[j] + head_cost)
        if cost < final:
            final, start = cost, j
    bounds = [n, start]
    for where in reversed(cut):
        bounds.append(where[bounds[-1]])
    bounds.reverse()  # [0, ..., start of the final stage, n]
    return list(zip(bounds[:-1], bounds[1:]))


def stage_shares(layer_costs: Sequence[int], head_cost: int, ranges: Sequence[tuple[int, int]]) -> list[float]:
    """Each stage's share of a decode step's multiply-adds (the final stage's includes the LM head)."""
    costs = [sum(layer_costs[a:b]) for a, b in ranges]
    costs[-1] += head_cost
    total = sum(costs) or 1
    return [c / total for c in costs]


# --- architecture policy -----------------------------------------------------


def check_splittable(source: gguf.GGUFReader | Mapping[str, Any]) -> str:
    """Return the architecture if this model can be split faithfully, else raise `SliceError`.

    `source` is an open reader or a plain mapping of metadata key -> value.
    """
    if isinstance(source, gguf.GGUFReader):
        keys = list(source.fields)

        def get(key: str) -> Any:
            return field_value(source, key)
    else:
        keys = list(source)
        get = source.get

    arch = get(gguf.Keys.General.ARCHITECTURE)
    if not isinstance(arch, str) or not arch:
        raise SliceError("the model has no general.architecture, so it cannot be split")
    verdict = support(arch)
    if not verdict.splits:
        raise SliceError(f"cannot split architecture {arch!r}: {verdict.reason}")
    for suffix, reason in _UNSPLITTABLE_KEYS.items():
        key = f"{arch}.{suffix}"
        value = get(key)
        if key in keys and value not in (None, 0):
            raise SliceError(f"cannot split this {arch} model: it sets {key} ({reason})")
    if get(SKIPPY_OUTPUT) is not None:
        raise SliceError(
            f"this file is already a stage slice (layers {get(SKIPPY_LAYER_START)}..{get(SKIPPY_LAYER_END)} "
            f"of {get(SKIPPY_N_LAYER_TOTAL)}); split the original model instead"
        )
    split_count = get(gguf.Keys.Split.LLM_KV_SPLIT_COUNT)
    if isinstance(split_count, int) and split_count > 1:
        raise SliceError(
            f"this file is one shard of a {split_count}-part GGUF; merge it first "
            "(llama-gguf-split --merge) and split the merged file"
        )
    return arch


# --- splitting ---------------------------------------------------------------


@attrs.frozen
class _KV:
    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None


@attrs.frozen
class _StagePlan:
    index: int
    start: int
    end: int
    output: str
    path: Path
    tensors: list[tuple[str, gguf.ReaderTensor]]

    @property
    def tensor_bytes(self) -> int:
        return sum(int(t.n_bytes) for _, t in self.tensors)


def stage_file_name(index: int) -> str:
    return f"stage-{index}.gguf"


_collector_lock = threading.Lock()
_collector_holds = 0  # slicings running with the cycle collector held off
_collector_was_on = True  # whether it ran before the first of them


@contextlib.contextmanager
def _no_collector_pauses():
    """Hold Python's cycle collector off while a GGUF is read and written. Reading one makes about a million
    small objects (its metadata's parts), and each full collection over them holds the GIL (a second for a
    262k-token vocabulary), which stalls the event loop of a daemon that slices in a worker thread. They go
    by reference counting anyway; the collector runs again once the last slicing is done."""
    global _collector_holds, _collector_was_on
    with _collector_lock:
        if _collector_holds == 0:
            _collector_was_on = gc.isenabled()
        _collector_holds += 1
        gc.disable()
    try:
        yield
    finally:
        with _collector_lock:
            _collector_holds -= 1
            if _collector_holds == 0 and _collector_was_on:
                gc.enable()


def _without_collector_pauses(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _no_collector_pauses():
            return fn(*args, **kwargs)
    return wrapper


@_without_collector_pauses
def split_model(
    src_path: str | os.PathLike[str],
    ranges: str | Sequence[tuple[int, int]] | None,
    out_dir: str | os.PathLike[str],
    *,
    stages: int | None = None,
    progress: Progress | None = None,
    hosts: Sequence[str] | None = None,
    host: str = DEFAULT_HOST,
    base_port: int = DEFAULT_BASE_PORT,
    balance: str = "layers",
    on_plan: Callable[[list[tuple[int, int]], list[float]], None] | None = None,
) -> Topology:
    """Write one stage file per layer range into `out_dir`, plus `topology.toml`.

    Give `ranges` (what `plan_ranges` accepts, validated against the model)
    or, with `ranges=None`, a number of `stages`: split into equal layer
    counts (`balance="layers"`) or equal work per token (`"compute"`, see
    `compute_costs` and `balanced_ranges`: the final stage, which also runs
    the LM head, gets fewer layers). Stage K
    listens on `hosts[K]` ("HOST:PORT") if given, else on `host:base_port+K`.
    `on_plan(ranges, shares)` is called once the ranges are chosen, with each
    stage's share of a decode step's multiply-adds (`stage_shares`).
    `progress(done_bytes, total_bytes)` is called as the source is hashed and
    as tensor data is written. Existing stage files of the same names are
    replaced; nothing else in `out_dir` is touched. Returns the topology that was written.
    Raises `ModelFileError` for a bad source file and `SliceError` for a
    model or request that cannot be split.
    """
    src_path = Path(src_path)
    out_dir = Path(out_dir)
    for address in hosts or ():
        parse_address(address)  # a typo must not wait for the model to be parsed
    reader = open_gguf(src_path)
    arch = check_splittable(reader)

    n_layer = _required_int(reader, f"{arch}.block_count")
    n_embd = _required_int(reader, f"{arch}.embedding_length")
    n_vocab = field_length(reader, gguf.Keys.Tokenizer.LIST) or _required_int(reader, f"{arch}.vocab_size")
    if balance not in BALANCE_MODES:
        raise RangeError(f"balance must be one of {', '.join(BALANCE_MODES)}, not {balance!r}")
    planned = plan_ranges(n_layer, stages=stages, ranges=ranges)
    layer_costs, head_cost = compute_costs(reader, n_layer)
    if balance == "compute":
        if stages is None:
            raise RangeError("balancing by compute chooses the ranges: give a number of stages, not ranges")
        planned = balanced_ranges(layer_costs, head_cost, stages)
    if on_plan is not None:
        on_plan(planned, stage_shares(layer_costs, head_cost, planned))
    # Cheap checks before the expensive work: nothing is written if these fail.
    addresses = stage_addresses(len(planned), hosts, host=host, base_port=base_port)

    if out_dir.exists() and not out_dir.is_dir():
        raise SliceError(f"{out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SliceError(f"{out_dir}: cannot create directory: {exc.strerror or exc}") from None

    plans = _plan_stages(reader, planned, n_layer, out_dir)
    kv = _copyable_kv(reader)
    _check_free_space(out_dir, sum(p.tensor_bytes for p in plans))

    total = src_path.stat().st_size + sum(p.tensor_bytes for p in plans)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    source_sha256 = _sha256_file(src_path, advance)
    specs = []
    for plan, (stage_host, stage_port) in zip(plans, addresses):
        try:
            digest = _write_stage(reader, arch, kv, plan, n_layer, source_sha256, advance)
        except OSError as exc:
            raise SliceError(f"{plan.path}: cannot write stage file: {exc.strerror or exc}") from None
        specs.append(StageSpec(
            index=plan.index,
            file=plan.path.resolve(),
            sha256=digest,
            layer_start=plan.start,
            layer_end=plan.end,
            host=stage_host,
            port=stage_port,
            output=plan.output,  # type: ignore[arg-type]
        ))

    topology = Topology(
        model_name=src_path.name.removesuffix(".gguf"),
        source_sha256=source_sha256,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        architecture=arch,
        stages=specs,
    )
    try:
        topology.dump(out_dir / TOPOLOGY_FILE)
    except OSError as exc:
        raise SliceError(f"{out_dir / TOPOLOGY_FILE}: cannot write: {exc.strerror or exc}") from None
    return topology


@_without_collector_pauses
def write_middle_slice(src_path: str | os.PathLike[str], start: int, end: int, out_path: Path) -> str:
    """Write the one middle-stage file of layers [start, end) (0 < start < end < n_layer: hidden states in
    and out) to `out_path`, as a split would make it; returns its sha256. For timing a host on a few layers
    without writing the whole model."""
    src_path = Path(src_path)
    reader = open_gguf(src_path)
    arch = check_splittable(reader)
    n_layer = _required_int(reader, f"{arch}.block_count")
    if not 0 < start < end < n_layer:
        raise RangeError(f"a middle slice needs 0 < start < end < {n_layer}, got {start}:{end}")
    plan = _plan_stages(reader, [(0, start), (start, end), (end, n_layer)], n_layer, out_path.parent)[1]
    plan = attrs.evolve(plan, path=out_path)
    source_sha256 = _sha256_file(src_path, lambda _n: None)
    return _write_stage(reader, arch, _copyable_kv(reader), plan, n_layer, source_sha256, lambda _n: None)


def _required_int(reader: gguf.GGUFReader, key: str) -> int:
    value = field_value(reader, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFileError(f"{reader.data.filename}: metadata {key} is missing or invalid ({value!r})")
    return value


def _plan_stages(
    reader: gguf.GGUFReader, ranges: list[tuple[int, int]], n_layer: int, out_dir: Path
) -> list[_StagePlan]:
    """Decide which tensors, under which names, go into each stage file."""
    shared: list[gguf.ReaderTensor] = []
    final_only: list[gguf.ReaderTensor] = []
    by_layer: dict[int, list[gguf.ReaderTensor]] = {}
    for t in reader.tensors:
        m = _BLOCK_RE.match(t.name)
        if m is None:
            (final_only if t.name in _FINAL_ONLY_TENSORS else shared).append(t)
            continue
        layer = int(m.group(1))
        if layer >= n_layer:
            raise SliceError(
                f"tensor {t.name} belongs to layer {layer}, beyond block_count {n_layer} "
                "(extra layers such as next-token-prediction heads are not supported)"
            )
        by_layer.setdefault(layer, []).append(t)
    names = {t.name for t in shared}
    for required in _REQUIRED_TENSORS:
        if required not in names:
            raise SliceError(f"the model has no {required} tensor, which every stage file needs")
    missing = [i for i in range(n_layer) if i not in by_layer]
    if missing:
        raise SliceError(f"the model has no tensors for layer(s) {missing[:5]} of 0..{n_layer - 1}")

    plans = []
    for k, (start, end) in enumerate(ranges):
        is_final = k == len(ranges) - 1
        tensors: list[tuple[str, gguf.ReaderTensor]] = [(t.name, t) for t in shared]
        for layer in range(start, end):
            for t in by_layer[layer]:
                suffix = _BLOCK_RE.match(t.name).group(2)  # type: ignore[union-attr]
                tensors.append((f"blk.{layer - start}.{suffix}", t))
        if is_final:
            tensors += [(t.name, t) for t in final_only]
        plans.append(_StagePlan(
            index=k,
            start=start,
            end=end,
            output="logits" if is_final else "hidden",
            path=out_dir / stage_file_name(k),
            tensors=tensors,
        ))
    return plans


def _copyable_kv(reader: gguf.GGUFReader) -> list[_KV]:
    """Decode every metadata field once (the vocabulary is large), in file order."""
    out = []
    for field in reader.fields.values():
        # GGUF.* are the reader's virtual header fields; the writer adds the architecture itself.
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        vtype = field.types[0]
        sub_type = None
        if vtype == gguf.GGUFValueType.ARRAY:
            # parts = [key_len, key, value_type, item_type, count, items...]. The item
            # type is read from the file: `field.types` has none for an empty array.
            sub_type = gguf.GGUFValueType(int(field.parts[3][0]))
            if sub_type == gguf.GGUFValueType.ARRAY:
                raise SliceError(f"metadata {field.name} is a nested array, which the gguf package cannot copy")
        out.append(_KV(field.name, field.contents(), vtype, sub_type))
    return out


def _stage_kv(kv: list[_KV], arch: str, plan: _StagePlan, n_layer: int) -> list[_KV]:
    """The source metadata adjusted for one stage, plus the skippy.* stage keys.

    Per-layer arrays stay whole: the patched loader reads every hyperparameter for the whole model (its
    layer patterns are counted from layer 0) and then keeps those of layers [layer_start, layer_end)."""
    u32, string = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING
    out = []
    for item in kv:
        if item.key == f"{arch}.block_count":
            item = attrs.evolve(item, value=plan.end - plan.start)
        out.append(item)
    return out + [
        _KV(SKIPPY_LAYER_START, plan.start, u32, None),
        _KV(SKIPPY_LAYER_END, plan.end, u32, None),
        _KV(SKIPPY_N_LAYER_TOTAL, n_layer, u32, None),
        _KV(SKIPPY_OUTPUT, plan.output, string, None),
    ]


def _pad(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _write_stage(
    reader: gguf.GGUFReader,
    arch: str,
    kv: list[_KV],
    plan: _StagePlan,
    n_layer: int,
    source_sha256: str,
    advance: Callable[[int], None],
) -> str:
    """Write one stage file atomically and return its sha256.

    The hash is computed while writing (header read back, then the exact
    padding and tensor bytes the writer emits) so the file is not read twice.
    """
    tmp = plan.path.with_name(f".{plan.path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    align = int(reader.alignment)
    writer.data_alignment = align
    for item in _stage_kv(kv, arch, plan, n_layer):
        writer.add_key_value(item.key, item.value, item.vtype, sub_type=item.sub_type)
    writer.add_key_value(SKIPPY_SOURCE_SHA256, source_sha256, gguf.GGUFValueType.STRING)
    for name, t in plan.tensors:
        # Raw bytes in the source's own type: quantized data is never touched.
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        fout.flush()
        header_len = fout.tell()
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            digest.update(f.read(header_len))
        for name, t in plan.tensors:
            pos = fout.tell()
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
            before = _pad(pos, align) - pos
            after = _pad(int(t.data.nbytes), align) - int(t.data.nbytes)
            digest.update(bytes(before))
            digest.update(t.data)
            digest.update(bytes(after))
            if fout.tell() != pos + before + t.data.nbytes + after:
                raise SliceError(f"internal error: unexpected layout while writing {name} to {tmp}")
            advance(int(t.n_bytes))
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, plan.path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def _sha256_file(path: Path, advance: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


def _check_free_space(out_dir: Path, tensor_bytes: int) -> None:
    # Metadata (vocabulary, merges) adds a few MB per stage; 5% slack covers it.
    needed = int(tensor_bytes * 1.05)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise SliceError(
            f"{out_dir}: not enough free space for the stage files "
            f"(need about {needed / 1e6:,.0f} MB, {free / 1e6:,.0f} MB free)"
        )
