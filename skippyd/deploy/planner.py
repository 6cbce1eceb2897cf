"""Choose how many stages a model runs in and which contiguous layers go to which host.

The inputs are the model's shape (read once from its GGUF: bytes and multiply-adds per layer, what the
first and final stages hold besides their layers, the KV cache per layer and token) and the hosts, each with
the memory skippy may use there and a calibration (milliseconds of one decode step per layer of this model).

The rule: as few stages as the model fits in, because every extra stage adds a network hop to each token;
for that count, the hosts, their order and the layer ranges whose slowest stage is fastest (where a host goes
matters: the final stage also runs the LM head, the first only looks up the embedding). Of equal plans, the
hosts in the order the user gave. Everything is exact integer arithmetic, so the same inputs always give the
same plan, ties included.

Memory counts what a stage reads, and the budget of its prefix cache on that host (the KV of prompts it keeps
in host memory, up to runtime.prefix_cache_mb there). A stage file also carries the token embedding and the
output norm, which the llama loader insists on even where a stage never uses them; libllama maps (and
pre-faults) the whole file, but pages a stage never reads are clean page cache the kernel takes back under
pressure, so they are disk (`ModelShape.file_bytes`), not memory the stage needs.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import gguf

from skippyd.runtime.gguf_info import (
    SKIPPY_LAYER_END,
    SKIPPY_LAYER_START,
    SKIPPY_N_LAYER_TOTAL,
    SKIPPY_OUTPUT,
    ModelFileError,
    architecture,
    field_value,
    open_gguf,
)
from skippyd.runtime.slicing import RangeError, compute_costs, plan_ranges
from skippyd.wire.messages import f16_threshold_Bps

MIB = 1 << 20
DEFAULT_MARGIN_BYTES = 64 * MIB
DEFAULT_MARGIN_FRACTION = 0.10
KV_BYTES_PER_VALUE = 2  # the KV cache is f16

# The LM head, which only the final stage file carries (as the slicer writes them).
_HEAD_TENSORS = frozenset({"output.weight", "output.bias"})
_TOKEN_EMBD = "token_embd.weight"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


class PlanError(ValueError):
    """The planner was asked something it cannot answer (bad hosts, stage count, model); the message says why."""


class PlanRefused(PlanError):
    """No placement fits the hosts' memory; the message names the host(s) and the shortfall."""


# --------------------------------------------------------------------------- the model


@attrs.frozen
class ModelShape:
    """What placing a model needs to know about it, in bytes and multiply-adds.

    `first_bytes` and `last_bytes` are what the first and the final stage hold beyond their layers (the
    token embedding; the LM head and the output norm). A model that ties its LM head to the token embedding
    counts that tensor in both, and `shared_bytes` says how much of them is the same tensor, which a single
    stage holds once. `carried_bytes` is what every stage file holds beyond its layers (see `file_bytes`).
    """

    name: str
    n_layer: int
    layer_bytes: tuple[int, ...]
    first_bytes: int
    last_bytes: int
    layer_costs: tuple[int, ...]
    head_cost: int
    kv_bytes_per_layer_token: int
    shared_bytes: int = 0
    carried_bytes: int = 0
    n_embd: int = 0  # the hidden state's width (a stage before the final one keeps a row of it per position)

    def weight_bytes(self, start: int, end: int) -> int:
        """Tensor bytes a stage running layers [start, end) reads: its layers, plus the embedding on the
        first stage and the LM head and output norm on the final one."""
        total = sum(self.layer_bytes[start:end])
        if start == 0:
            total += self.first_bytes
        if end == self.n_layer:
            total += self.last_bytes
        if start == 0 and end == self.n_layer:
            total -= self.shared_bytes
        return total

    def file_bytes(self, start: int, end: int) -> int:
        """Tensor bytes of the stage file the slicer writes for layers [start, end): its layers and every
        tensor outside the blocks, the LM head only on the final stage (the disk a slice takes, less the
        metadata and alignment)."""
        total = sum(self.layer_bytes[start:end])
        if end == self.n_layer:
            return total + self.first_bytes + self.last_bytes - self.shared_bytes
        return total + self.carried_bytes

    def kv_bytes(self, start: int, end: int, *, ctx: int, lanes: int) -> int:
        """The KV cache of layers [start, end) for `lanes` sequences of `ctx` tokens each."""
        return self.kv_bytes_per_layer_token * (end - start) * ctx * lanes

    def boundary_bytes(self, end: int, *, ctx: int, lanes: int) -> int:
        """The boundary rows of a stage ending at layer `end` (skippyd/stage/boundary.py): the hidden state it
        sent on for every position its `lanes` sequences of `ctx` tokens hold, float32; none on the final
        stage."""
        return 0 if end >= self.n_layer else 4 * self.n_embd * ctx * lanes


def model_shape(path: str | os.PathLike[str]) -> ModelShape:
    """Read a model's shape from its GGUF (the metadata and tensor table; no tensor data).

    Raises `ModelFileError` for a bad file and `PlanError` for a stage slice (plan the model it came from).
    """
    path = Path(path)
    reader = open_gguf(path)
    if reader.get_field(SKIPPY_OUTPUT) is not None:
        raise PlanError(
            f"{path}: is a stage slice (layers {field_value(reader, SKIPPY_LAYER_START)}.."
            f"{field_value(reader, SKIPPY_LAYER_END)} of {field_value(reader, SKIPPY_N_LAYER_TOTAL)}); "
            "plan the whole model it was cut from"
        )
    arch = architecture(reader)
    n_layer = _positive_int(reader, path, f"{arch}.block_count")
    n_embd = _positive_int(reader, path, f"{arch}.embedding_length")
    n_head = _positive_int(reader, path, f"{arch}.attention.head_count")
    n_head_kv = field_value(reader, f"{arch}.attention.head_count_kv", n_head)
    if isinstance(n_head_kv, list):  # per-layer counts: the largest, so that no layer is under-counted
        n_head_kv = max(n_head_kv, default=0)
    if not isinstance(n_head_kv, int) or n_head_kv < 0:
        raise ModelFileError(f"{path}: metadata {arch}.attention.head_count_kv is invalid ({n_head_kv!r})")
    head_k = field_value(reader, f"{arch}.attention.key_length") or n_embd // n_head
    head_v = field_value(reader, f"{arch}.attention.value_length") or n_embd // n_head
    kv_per_layer_token = (head_k + head_v) * n_head_kv * KV_BYTES_PER_VALUE

    layer_bytes = [0] * n_layer
    first = last = carried = 0
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    embd = 0
    for t in reader.tensors:
        n = int(t.n_bytes)
        m = _BLOCK_RE.match(t.name)
        if m is not None and int(m.group(1)) < n_layer:
            layer_bytes[int(m.group(1))] += n
            continue
        if t.name not in _HEAD_TENSORS:
            carried += n
        if m is not None or t.name in _HEAD_TENSORS or t.name.startswith("output_norm."):
            last += n  # layers past block_count (prediction heads) follow the stack: the final stage's
        else:
            first += n
            if t.name == _TOKEN_EMBD:
                embd = n
    shared = embd if tied else 0
    last += shared
    layer_costs, head_cost = compute_costs(reader, n_layer)
    return ModelShape(
        name=path.name.removesuffix(".gguf"),
        n_layer=n_layer,
        layer_bytes=tuple(layer_bytes),
        first_bytes=first,
        last_bytes=last,
        layer_costs=tuple(layer_costs),
        head_cost=head_cost,
        kv_bytes_per_layer_token=kv_per_layer_token,
        shared_bytes=shared,
        carried_bytes=carried,
        n_embd=n_embd,
    )


def _positive_int(reader: gguf.GGUFReader, path: Path, key: str) -> int:
    value = field_value(reader, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelFileError(f"{path}: metadata {key} is missing or invalid ({value!r})")
    return value


# --------------------------------------------------------------------------- hosts and plans


@attrs.frozen
class HostInfo:
    """A host as the planner sees it: its name (the control address the user gave), the memory skippy may use
    there, how long one decode step takes per layer of this model there, and the prefix cache budget of the
    stage it would run (runtime.prefix_cache_mb there: host memory the stage may fill besides its weights and
    KV cache)."""

    name: str
    memory_bytes: int
    ms_per_layer: float
    prefix_cache_bytes: int = 0

    @property
    def room(self) -> int:
        """What a stage's weights, KV cache and margins may take here: the memory less the prefix cache."""
        return self.memory_bytes - self.prefix_cache_bytes


@attrs.frozen
class StagePlacement:
    index: int
    host: str
    layer_start: int
    layer_end: int
    memory_bytes: int  # its prefix cache's budget included
    ms_per_token: float
    prefix_cache_bytes: int = 0


@attrs.frozen
class DeployPlan:
    """Stages in pipeline order; `ms_per_token` is one token's trip: every stage's step plus the hops."""

    model: str
    stages: tuple[StagePlacement, ...]
    ms_per_token: float
    n_embd: int = 0  # the model's width: what each link's activation_wire threshold follows from

    def f16_below_mbps(self, stage: StagePlacement) -> float | None:
        """The rate at or below which the link from ``stage`` to the next takes f16 under runtime.activation_wire
        "auto" (skippyd/stage/link_choice.py), from the stage's expected compute per token (a decode step's,
        which a prompt row costs about as much as); None for the final stage, or no width known."""
        if stage.index == len(self.stages) - 1 or not self.n_embd or stage.ms_per_token <= 0:
            return None
        threshold = f16_threshold_Bps(self.n_embd, stage.ms_per_token / 1e3)
        return None if threshold is None else round(threshold * 8 / 1e6, 3)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(s.layer_start, s.layer_end) for s in self.stages]

    @property
    def hosts(self) -> list[str]:
        return [s.host for s in self.stages]

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "ms_per_token": self.ms_per_token,
            "stages": [
                {
                    "index": s.index,
                    "host": s.host,
                    "layers": [s.layer_start, s.layer_end],
                    "layer_start": s.layer_start,
                    "layer_end": s.layer_end,
                    "memory_bytes": s.memory_bytes,
                    "memory_mib": round(s.memory_bytes / MIB, 1),
                    "prefix_cache_bytes": s.prefix_cache_bytes,
                    "ms_per_token": s.ms_per_token,
                    "f16_below_mbps": self.f16_below_mbps(s),
                }
                for s in self.stages
            ],
        }


def stage_memory(
    shape: ModelShape,
    start: int,
    end: int,
    *,
    ctx: int,
    lanes: int,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    margin_fraction: float = DEFAULT_MARGIN_FRACTION,
) -> int:
    """Bytes a stage running layers [start, end) needs: its weights, KV cache and (before the final stage)
    boundary rows, a fraction more for what grows with them, and a fixed margin for the runtime and llama.cpp's
    compute buffers."""
    raw = (shape.weight_bytes(start, end) + shape.kv_bytes(start, end, ctx=ctx, lanes=lanes)
           + shape.boundary_bytes(end, ctx=ctx, lanes=lanes))
    return margin_bytes + math.ceil(raw * (1 + margin_fraction))


# --------------------------------------------------------------------------- the choice


def make_plan(
    shape: ModelShape,
    hosts: Sequence[HostInfo],
    *,
    ctx: int,
    lanes: int,
    stages: int | None = None,
    hop_ms: float = 1.0,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    margin_fraction: float = DEFAULT_MARGIN_FRACTION,
) -> DeployPlan:
    """Place `shape` on (some of) `hosts`, each stage with its KV cache for `lanes` sequences of `ctx` tokens.

    `stages=None`: the fewest stages that fit (one host if any can hold the whole model). `stages=N`: exactly
    N stages on N of the hosts. Among the placements of that many stages: the smallest slowest-stage time,
    then the smallest sum of stage times, then the earliest layer boundaries, then the hosts in the order given
    (any order of up to ORDERS_UP_TO hosts is considered; of more, the order given).
    Raises `PlanError` for bad arguments and `PlanRefused` when nothing fits.
    """
    _check_arguments(shape, hosts, ctx, lanes, stages, hop_ms, margin_bytes, margin_fraction)
    n = shape.n_layer

    def need(a: int, b: int) -> int:
        return stage_memory(shape, a, b, ctx=ctx, lanes=lanes, margin_bytes=margin_bytes,
                            margin_fraction=margin_fraction)

    needs = [[need(a, b) if b > a else 0 for b in range(n + 1)] for a in range(n + 1)]
    # A stage's time is its host's ms per layer times its multiply-adds over a mean layer's. Compared as exact
    # integers: each host's ms per layer as an integer over a common power of two, times integer costs.
    ratios = [float(h.ms_per_layer).as_integer_ratio() for h in hosts]
    denominator = max(den for _, den in ratios)
    speed = [num * (denominator // den) for num, den in ratios]
    prefix = list(itertools.accumulate(shape.layer_costs, initial=0))

    def cost(a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (shape.head_cost if b == n else 0)

    counts = [stages] if stages is not None else range(1, min(len(hosts), n) + 1)
    for k in counts:
        best: tuple | None = None
        for subset in _orders(len(hosts), k):
            found = _best_ranges(n, [hosts[i].room for i in subset], [speed[i] for i in subset],
                                 needs, cost)
            if found is not None and (best is None or found + (subset,) < best):
                best = found + (subset,)
        if best is not None:
            _, _, bounds, subset = best
            return _plan(shape, hosts, subset, bounds, needs, prefix, hop_ms)
    raise PlanRefused(_refusal(shape, hosts, stages, needs, ctx, lanes))


def _best_ranges(n: int, memory: list[int], speed: list[int], needs: list[list[int]],
                 cost: Callable[[int, int], int]) -> tuple[int, int, tuple[int, ...]] | None:
    """For hosts in this order (their memory and integer speeds), the contiguous ranges of at least one layer
    each that fit every host: (slowest stage, sum of stages, boundaries), the smallest such triple; None if
    nothing fits.

    Two passes of dynamic programming over the layers: the smallest possible slowest stage first, then,
    holding every stage to it, the smallest sum and the earliest boundaries (both add up stage by stage,
    which the slowest stage alone does not)."""
    k = len(memory)

    def stage_options(t: int, i: int):
        """Ends j of stage t starting at layer i whose memory fits; memory grows with j, so stop at the first
        that does not."""
        last_end = n if t == k - 1 else n - (k - 1 - t)
        first_end = n if t == k - 1 else i + 1
        for j in range(first_end, last_end + 1):
            if needs[i][j] > memory[t]:
                return
            yield j

    # pass 1: slow[j] = the smallest slowest stage of t+1 stages covering [0, j)
    slow: dict[int, int] = {0: 0}
    for t in range(k):
        nxt: dict[int, int] = {}
        for i, so_far in slow.items():
            for j in stage_options(t, i):
                value = max(so_far, speed[t] * cost(i, j))
                if value < nxt.get(j, value + 1):
                    nxt[j] = value
        slow = nxt
    if n not in slow:
        return None
    bound = slow[n]

    # pass 2: the smallest (sum, boundaries) with no stage slower than `bound`
    best: dict[int, tuple[int, tuple[int, ...]]] = {0: (0, ())}
    for t in range(k):
        nxt2: dict[int, tuple[int, tuple[int, ...]]] = {}
        for i, (total, bounds) in best.items():
            for j in stage_options(t, i):
                step = speed[t] * cost(i, j)
                if step > bound:
                    continue
                candidate = (total + step, bounds + (j,))
                if j not in nxt2 or candidate < nxt2[j]:
                    nxt2[j] = candidate
        best = nxt2
    total, bounds = best[n]
    return bound, total, bounds


def place(
    shape: ModelShape,
    hosts: Sequence[HostInfo],
    ranges: Sequence[tuple[int, int]],
    *,
    ctx: int,
    lanes: int,
    hop_ms: float = 1.0,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    margin_fraction: float = DEFAULT_MARGIN_FRACTION,
) -> DeployPlan:
    """The given layer ranges on the first hosts, in the order given (the operator chose them): their memory
    checked, their expected times. Raises `PlanError` for ranges that do not fit the model or the hosts'
    count, `PlanRefused` naming every host that lacks the memory for its stage."""
    _check_arguments(shape, hosts, ctx, lanes, len(ranges), hop_ms, margin_bytes, margin_fraction)
    try:
        ranges = plan_ranges(shape.n_layer, ranges=list(ranges))
    except RangeError as exc:
        raise PlanError(str(exc)) from None
    needs = {(a, b): stage_memory(shape, a, b, ctx=ctx, lanes=lanes, margin_bytes=margin_bytes,
                                  margin_fraction=margin_fraction) for a, b in ranges}
    short = [f"host {h.name} has {_mib(h.memory_bytes, up=False)} for skippy; layers {a}:{b} need "
             f"{_mib(needs[a, b] + h.prefix_cache_bytes)}{_with_cache(h)}: "
             f"{_mib(needs[a, b] - h.room)} short"
             for h, (a, b) in zip(hosts, ranges) if needs[a, b] > h.room]
    if short:
        raise PlanRefused(f"cannot run {shape.name} in these ranges: " + "; ".join(short))
    table = [[needs.get((a, b), 0) for b in range(shape.n_layer + 1)] for a in range(shape.n_layer + 1)]
    prefix = list(itertools.accumulate(shape.layer_costs, initial=0))
    return _plan(shape, hosts, tuple(range(len(ranges))), tuple(b for _, b in ranges), table, prefix, hop_ms)


ORDERS_UP_TO = 6  # hosts: up to this many, every order of them is tried; more, the order given


def _orders(n_hosts: int, k: int):
    """The hosts (indices) a k-stage pipeline may run through, in order. Every order where the hosts are few:
    where the slow host goes matters (the final stage also runs the LM head, worth several layers; the first
    only looks up the embedding), and the order given comes first among equals."""
    if n_hosts <= ORDERS_UP_TO:
        return itertools.permutations(range(n_hosts), k)
    return itertools.combinations(range(n_hosts), k)


def _plan(shape: ModelShape, hosts: Sequence[HostInfo], subset: tuple[int, ...], bounds: tuple[int, ...],
          needs: list[list[int]], prefix: list[int], hop_ms: float) -> DeployPlan:
    mean = prefix[-1] / shape.n_layer
    placements = []
    start = 0
    for index, (h, end) in enumerate(zip(subset, bounds)):
        host = hosts[h]
        work = prefix[end] - prefix[start] + (shape.head_cost if end == shape.n_layer else 0)
        placements.append(StagePlacement(
            index=index,
            host=host.name,
            layer_start=start,
            layer_end=end,
            memory_bytes=needs[start][end] + host.prefix_cache_bytes,
            ms_per_token=host.ms_per_layer * work / mean,
            prefix_cache_bytes=host.prefix_cache_bytes,
        ))
        start = end
    total = sum(p.ms_per_token for p in placements) + hop_ms * (len(placements) - 1)
    return DeployPlan(model=shape.name, stages=tuple(placements), ms_per_token=total, n_embd=shape.n_embd)


def _check_arguments(shape: ModelShape, hosts: Sequence[HostInfo], ctx: int, lanes: int, stages: int | None,
                     hop_ms: float, margin_bytes: int, margin_fraction: float) -> None:
    n = shape.n_layer
    if n < 1 or len(shape.layer_bytes) != n or len(shape.layer_costs) != n:
        raise PlanError(f"model {shape.name} has {n} layers but {len(shape.layer_bytes)} layer sizes and "
                        f"{len(shape.layer_costs)} layer costs")
    if sum(shape.layer_costs) <= 0:
        raise PlanError(f"model {shape.name} has no multiply-adds in its layers to balance")
    if not hosts:
        raise PlanError("no hosts to place the model on")
    seen: set[str] = set()
    for h in hosts:
        if not h.name:
            raise PlanError("a host has an empty name")
        if h.name in seen:
            raise PlanError(f"host {h.name} is given twice")
        seen.add(h.name)
        if h.memory_bytes < 0 or h.prefix_cache_bytes < 0:
            raise PlanError(f"host {h.name}: memory {h.memory_bytes} or prefix cache {h.prefix_cache_bytes} is "
                            f"negative")
        if not (math.isfinite(h.ms_per_layer) and h.ms_per_layer > 0):
            raise PlanError(f"host {h.name}: ms per layer must be a positive number, not {h.ms_per_layer}")
    if ctx < 1:
        raise PlanError(f"the context must be at least 1 token, not {ctx}")
    if lanes < 1:
        raise PlanError(f"lanes must be at least 1, not {lanes}")
    if not (math.isfinite(hop_ms) and hop_ms >= 0):
        raise PlanError(f"hop_ms must be a number of at least 0, not {hop_ms}")
    if margin_bytes < 0 or not (math.isfinite(margin_fraction) and margin_fraction >= 0):
        raise PlanError("the memory margins must not be negative")
    if stages is not None:
        if stages < 1:
            raise PlanError(f"the number of stages must be at least 1, got {stages}")
        if stages > n:
            raise PlanError(f"cannot split {n} layers into {stages} stages: every stage needs at least one layer")
        if stages > len(hosts):
            raise PlanError(f"{stages} stages need {stages} hosts, {len(hosts)} given")


# --------------------------------------------------------------------------- refusals


def _mib(n: int, *, up: bool = True) -> str:
    """Bytes in MiB, rounded up (what is needed, what is short) or down (what a host has)."""
    return f"{math.ceil(n / MIB) if up else n // MIB:,} MiB"


def _with_cache(h: HostInfo) -> str:
    return f" (its prefix cache's {_mib(h.prefix_cache_bytes)} included)" if h.prefix_cache_bytes else ""


def _smallest_stage(shape: ModelShape, k: int, needs: list[list[int]]) -> tuple[int, str]:
    """The smallest stage any host must hold for a k-stage pipeline, and what it is."""
    n = shape.n_layer
    if k == 1:
        return needs[0][n], f"all {n} layers, the token embedding and the LM head"
    options = [(needs[0][1], "1 layer + the token embedding"), (needs[n - 1][n], "1 layer + the LM head")]
    if k >= 3:
        options += [(needs[i][i + 1], "1 layer") for i in range(1, n - 1)]
    return min(options, key=lambda o: o[0])


def _refusal(shape: ModelShape, hosts: Sequence[HostInfo], stages: int | None, needs: list[list[int]],
             ctx: int, lanes: int) -> str:
    n = shape.n_layer
    k = stages if stages is not None else min(len(hosts), n)
    if stages is not None:
        smallest, what = _smallest_stage(shape, k, needs)
        short = [h for h in hosts if h.room < smallest]
        if len(hosts) - len(short) < k:
            named = "; ".join(
                f"host {h.name} has {_mib(h.memory_bytes, up=False)} for skippy; the smallest stage it could run "
                f"({what}) needs {_mib(smallest + h.prefix_cache_bytes)}{_with_cache(h)}: "
                f"{_mib(smallest - h.room)} short"
                for h in short
            )
            return f"cannot run {shape.name} in {k} stages: {named}"
    # The whole model over k stages: its weights and KV cache, each stage's margins.
    total = sum(needs[a][b] for a, b in plan_ranges(n, stages=k))
    have = sum(max(0, h.room) for h in hosts)
    each = ", ".join(f"{h.name} {_mib(max(0, h.room), up=False)}" for h in hosts)
    message = (
        f"{shape.name} does not fit: in {k} stage{'s' if k > 1 else ''} with a context of {ctx} tokens x "
        f"{lanes} lanes it needs {_mib(total)} in all, and the hosts have {_mib(have, up=False)} ({each})"
    )
    if any(h.prefix_cache_bytes for h in hosts):
        message += " after their prefix caches"
    if total <= have:
        message += (
            "; together enough, but no split into contiguous layers, in any order of the hosts, fits each "
            "host's share"
        )
    return message


# --------------------------------------------------------------------------- re-planning around a running head


def plan_tail(
    shape: ModelShape,
    head: HostInfo,
    head_end: int,
    hosts: Sequence[HostInfo],
    *,
    ctx: int,
    lanes: int,
    stages: int | None = None,
    hop_ms: float = 1.0,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    margin_fraction: float = DEFAULT_MARGIN_FRACTION,
) -> DeployPlan:
    """The head keeps layers [0, `head_end`) on its host (its clients are connected there, its generations
    run there); layers [`head_end`, n) go on (some of) `hosts` by make_plan's rule: `stages` stages after
    the head's (None: the fewest that fit), the smallest slowest stage, then the smallest sum, the earliest
    boundaries, the hosts in the order given. Raises `PlanRefused` naming the shortfall when nothing fits."""
    everyone = [head, *hosts]
    _check_arguments(shape, everyone, ctx, lanes, None, hop_ms, margin_bytes, margin_fraction)
    n = shape.n_layer
    if not 0 < head_end < n:
        raise PlanError(f"the head's layers 0:{head_end} leave nothing to place of {n} layers")
    if not hosts:
        raise PlanRefused(f"the model needs its layers {head_end}:{n} on another host, and none is left")
    needs = [[stage_memory(shape, a, b, ctx=ctx, lanes=lanes, margin_bytes=margin_bytes,
                           margin_fraction=margin_fraction) if b > a else 0 for b in range(n + 1)]
             for a in range(n + 1)]
    ratios = [float(h.ms_per_layer).as_integer_ratio() for h in everyone]
    denominator = max(den for _, den in ratios)
    speed = [num * (denominator // den) for num, den in ratios]
    prefix = list(itertools.accumulate(shape.layer_costs, initial=0))
    m = n - head_end
    tail_needs = [[needs[head_end + a][head_end + b] for b in range(m + 1)] for a in range(m + 1)]

    def cost(a: int, b: int) -> int:
        return prefix[head_end + b] - prefix[head_end + a] + (shape.head_cost if head_end + b == n else 0)

    counts = [min(stages, len(hosts), m)] if stages is not None else range(1, min(len(hosts), m) + 1)
    for k in counts:
        best: tuple | None = None
        for subset in _orders(len(hosts), k):
            found = _best_ranges(m, [hosts[i].room for i in subset], [speed[i + 1] for i in subset],
                                 tail_needs, cost)
            if found is not None and (best is None or found + (subset,) < best):
                best = found + (subset,)
        if best is not None:
            _, _, bounds, subset = best
            return _plan(shape, everyone, (0, *(i + 1 for i in subset)), (head_end, *(head_end + b for b in bounds)),
                         needs, prefix, hop_ms)
    # the head's memory is taken by its own layers: what is short is short on the hosts after it
    k = min(len(hosts), m)
    total = sum(needs[head_end + a][head_end + b] for a, b in plan_ranges(m, stages=k))
    have = sum(max(0, h.room) for h in hosts)
    names = _names([h.name for h in hosts])
    if total > have:
        raise PlanRefused(f"the model needs {human_size(total - have)} more than {names} "
                          f"{'hold' if len(hosts) > 1 else 'holds'} (layers {head_end}:{n}, besides the head's)")
    raise PlanRefused(f"the model's layers {head_end}:{n} fit {names} in all, but no split of them into contiguous "
                      "ranges fits each host's share")


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def human_size(n: int) -> str:
    """Bytes as an operator reads them: GiB with one decimal from 1 GiB, else MiB (rounded up)."""
    if n >= 1 << 30:
        return f"{math.ceil(n * 10 / (1 << 30)) / 10:.1f} GiB"
    return f"{math.ceil(n / MIB)} MiB"
