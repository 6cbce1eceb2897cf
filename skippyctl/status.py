"""skippyctl status: what the daemon runs and whether its pipeline is whole."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Column, Table

from skippyctl.client import ControlError, call_once
from skippyctl.render import emit, entries, fail, human_bytes, listing
from skippyd.control import messages as m


def _yes(value) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _table(data: dict) -> Table:
    model = data.get("model") or {}
    threads = _threads(data)
    table = listing("stage", Column("address", no_wrap=True), Column("layers", no_wrap=True), "local",
                    Column("threads", no_wrap=True), "device", "reachable", "protocol",
                    title=f"{data['role']} · {model.get('name', '?')} · up {data['uptime_s']:.0f}s"
                          + (" · draining" if data.get("draining") else ""),
                    caption=f"{_running(data)}; skippy {data.get('version')}"
                            + _down((data.get("head") or {}).get("downstream"))
                            + _lanes_task((data.get("head") or {}).get("lanes_task"))
                            + _listening(data.get("listeners"))
                            + _warnings(data.get("warnings"))
                            + _caches(data)
                            + _links(data)
                            + _speculation((data.get("head") or {}).get("speculation"))
                            + _vision((data.get("head") or {}).get("vision"))
                            + _supervised((data.get("deployment") or {}).get("supervised")))
    for s in (data.get("topology") or {}).get("stages", []):
        table.add_row(str(s["index"]), s["address"], f"[{s['layers'][0]},{s['layers'][1]})",
                      "yes" if s["local"] else "no", threads.get(s["index"], "-"),
                      _device(_local_device(data, s["index"])), _yes(s["reachable"]), _dash(s.get("version")))
    if not data.get("topology"):  # a single-model daemon (--model)
        for s in data.get("local_stages", []):
            table.add_row(str(s["index"]), s["listen"] or "-", f"[{s['layers'][0]},{s['layers'][1]})", "yes",
                          threads.get(s["index"], "-"), _device(_local_device(data, s["index"])), "yes",
                          str(data.get("protocol_version")))
    return table


def _device(device: dict | None) -> str:
    """What a stage computes on: "CPU", or the GPU, its layers there and its memory ("Vulkan0 llvmpipe (...)
    24/24 layers, 1.2 of 2.0 GiB free")."""
    if not device:
        return "-"
    if not device.get("gpu_layers"):
        return device.get("device", "CPU")
    memory = (f", {human_bytes(device['memory_free'])} of {human_bytes(device['memory_total'])} free"
              if device.get("memory_total") else "")
    return (f"{device.get('device')} {device.get('device_name', '')}: {device['gpu_layers']}/{device['layers']} "
            f"layers{memory}")


def _local_device(data: dict, index: int) -> dict | None:
    """The device of a stage this daemon runs, from its snapshot (None: a remote stage)."""
    snap = next((s for s in [data.get("head"), *(data.get("stages") or [])]
                 if s and s.get("stage_index") == index), None)
    return (snap or {}).get("device")


def _running(data: dict) -> str:
    """What the daemon runs now: the head's generations, or (a daemon of later stages only, which never sees a
    generation) its stages' sessions."""
    load = data.get("load") or {}
    if data.get("head") is None:
        return f"{sum((load.get('stage_sessions') or {}).values())} sessions live"
    return f"{load.get('live_generations', 0)} generations running, {load.get('totals', {}).get('generations', 0)} done"


def _threads(data: dict) -> dict[int, str]:
    """The compute threads of each stage this daemon runs: "N", or "N of M" while it computes with fewer than
    its M (other programs busy on its cores; runtime.adapt_threads in skippyd.toml(5))."""
    out = {}
    for snap in [data.get("head"), *(data.get("stages") or [])]:
        t = (snap or {}).get("threads")
        if t:
            now, configured = t["now"], t["configured"]
            out[snap["stage_index"]] = str(now) if now == configured else f"{now} of {configured}"
    return out


def _down(watch: dict | None) -> str:
    """The head's view of stage 1, when it stopped answering (new generations are refused meanwhile)."""
    if not watch or watch.get("state") != "down":
        return ""
    return f"\nstage {watch['stage']} is DOWN: {watch.get('error')}"


def _lanes_task(task: dict | None) -> str:
    """The head's task that keeps lanes open failed unexpectedly (a bug: it goes on, the log has the rest)."""
    if not task or not task.get("failures"):
        return ""
    return f"\nkeeping lanes open FAILED {task['failures']} time(s), last: {task.get('last_error')} (see the log)"


def _caches(data: dict) -> str:
    """A line per local stage: its prefix cache's entries, bytes held of its budget, and hit rate (and its disk
    tier's, when it has one)."""
    lines = []
    for snap in [data.get("head"), *(data.get("stages") or [])]:
        cache = (snap or {}).get("prefix_cache")
        if not cache:
            continue
        head = f"\nprefix cache of stage {snap['stage_index']}: "
        if not cache["budget_bytes"]:
            lines.append(head + "off")
            continue
        rate = f"hit rate {100 * cache['hit_rate']:.0f}% of {cache['lookups']}" if cache["lookups"] else "no lookups"
        disk = (f"; on disk {entries(cache['disk_entries'])}, {human_bytes(cache['disk_bytes'])} of "
                f"{human_bytes(cache['disk_budget_bytes'])}, {cache['disk_hits']} hits" if cache.get("disk_on") else "")
        lines.append(head + f"{entries(cache['entries'])}, {human_bytes(cache['bytes_held'])} of "
                            f"{human_bytes(cache['budget_bytes'])}, {rate}{disk}")
    return "".join(lines)


def _links(data: dict) -> str:
    """A line per link from a local stage: how its activations travel (runtime.activation_wire), the rate it
    measured when it opened, and the rate below which it would take f16."""
    lines = []
    for s in (data.get("topology") or {}).get("stages", []):
        link = s.get("link")
        if not link:
            continue
        line = f"\nlink {s['index']} → {link['to']}: {link['wire']} ({link['mode']}"
        if link.get("rate_mbps") is not None:
            line += f"; {link['rate_mbps']:.3g} Mbit/s measured"
        if link.get("threshold_mbps") is not None:
            line += f", f16 at {link['threshold_mbps']:.3g} Mbit/s or less"
        lanes = ", ".join(f"{n} {wire}" for wire, n in sorted(link.get("lanes", {}).items()))
        lines.append(line + f"; lanes: {lanes})")
    return "".join(lines)


def _speculation(spec: dict | None) -> str:
    """Speculative decoding on the head: off, or its windows and acceptance so far, and the acceptance of every
    running generation that drafts (by session id)."""
    if not spec:
        return ""
    if not spec["enabled"] and not spec["windows"]:
        return "\nspeculation: off"
    line = f"\nspeculation: {spec['windows']} windows, acceptance {_percent(spec['acceptance'])}"
    sessions = spec.get("sessions") or {}
    if sessions:
        line += "; running: " + ", ".join(f"session {sid} {_percent(a)}" for sid, a in sessions.items())
    return line


def _vision(vision: dict | None) -> str:
    """Images: the head's projector (its type), and the tokens an image of its input size becomes."""
    if not vision:
        return ""
    w, h = vision["image_size"]
    return (f"\nimages: {vision['projector']} ({vision['projector_type']}), {vision['tokens_per_image']} tokens "
            f"for a {w}x{h} image")


def _supervised(sup: dict | None) -> str:
    """A supervised deployment: its plan's generation and state, and every host offered (in plan, waiting,
    dropped, with why and since when)."""
    if not sup:
        return ""
    plan = " → ".join(f"{s['host']} {s['layers'][0]}:{s['layers'][1]}" for s in sup["plan"]["stages"])
    line = f"\ndeployment: generation {sup['generation']}, {sup['state']}" + (f" ({sup['why']})" if sup["why"] else "")
    line += f"\nplan: {plan}, {sup['plan']['ms_per_token']:.2f} ms per token expected"
    for h in sup["hosts"]:
        ago = max(0.0, time.time() - h["since"])
        line += f"\n  {h['name']}: {h['state']} for {ago:.0f}s" + (f": {h['reason']}" if h["reason"] else "")
    change = sup.get("change")
    if change:  # a re-plan or switch under way
        shipping = f" to {', '.join(change['shipping'])}" if change.get("shipping") else ""
        line += f"\nchange under way: {change['step']}{shipping} ({change['cause']})"
    last = sup.get("last_change")
    if last:
        line += f"\nlast change: {last['cause']} (generation {last['generation']}, {last['took_s']:.1f} s)"
    return line


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _listening(listeners: list[dict] | None) -> str:
    if not listeners:
        return ""
    return "\nlistening: " + ", ".join(f"{x['what']} {x['address']}" + ("" if x["loopback"] else " (not loopback)")
                                       + (" (API key)" if x.get("api_key") else "") for x in listeners)


def _warnings(warnings: list[str] | None) -> str:
    return "".join(f"\nWARNING: {line}" for line in warnings or ())


def _dash(value) -> str:
    return "-" if value is None else str(value)


def status(ctx: typer.Context,
           json_mode: Annotated[bool, typer.Option("--json", help="Plain JSON on stdout.")] = False) -> None:
    """Role, model, stages and their reachability, uptime and load."""
    try:
        data = call_once(ctx.obj.url, ctx.obj.token_file, lambda i: m.Status(id=i))
    except ControlError as exc:
        fail(str(exc))
    emit(data, json_mode, _table)
