"""skippyd: flags, logging, signals and drain — wires the stage servers, the head and the control channel.

    skippyd --topology DIR/topology.toml --stage K     run stage K (stage 0 is the head)
    skippyd --topology DIR/topology.toml --stage all   every stage of the topology in one daemon
    skippyd --model FILE.gguf                          the whole model as one stage
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

import trio

from skippyd.runtime.llama import LlamaError
from skippyd.stage.server import StageConfig, StageServer
from skippyd.topology import TopologyError
from skippyd.wire.messages import PROTOCOL_VERSION

log = logging.getLogger("skippyd")

DEFAULT_CONTROL = "127.0.0.1:7390"


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skippyd", description="skippy pipeline stage daemon (one per host).")
    src = p.add_argument_group("what to run")
    src.add_argument("--topology", type=Path, help="topology.toml written by `skippyctl model split`")
    src.add_argument("--stage", default=None, help="stage index to run, or 'all' (default: all)")
    src.add_argument("--model", type=Path, help="run this whole GGUF model as a single stage")
    run = p.add_argument_group("runtime")
    run.add_argument("--lanes", type=int, default=4, help="concurrent sessions per stage (KV sequences, default 4)")
    run.add_argument("--ctx", type=int, default=4096, help="context tokens per session (default 4096)")
    run.add_argument("--threads", type=int, default=None,
                     help="compute threads per stage (default: cores / stages on this host)")
    run.add_argument("--batch", type=int, default=512, help="max tokens per llama_decode (default 512)")
    run.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill chunk (default 256)")
    run.add_argument("--credit", type=int, default=2, help="outstanding prefill acks per link (default 2)")
    run.add_argument("--reply-timeout", type=float, default=30.0, help="seconds a stage may take to answer")
    net = p.add_argument_group("network")
    net.add_argument("--listen", type=_hostport, default=None,
                     help="HOST:PORT for this stage's listener (default: from the topology)")
    net.add_argument("--control", type=_hostport, default=_hostport(DEFAULT_CONTROL),
                     help=f"control websocket HOST:PORT on the head (default {DEFAULT_CONTROL})")
    net.add_argument("--control-token-file", type=Path, default=None,
                     help="file holding the control token (created 0600 if absent)")
    net.add_argument("--no-control", action="store_true", help="do not serve the control channel")
    p.add_argument("--receipts", type=Path, default=None, help="append a JSON line per generation to this file")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


class _JournalFormatter(logging.Formatter):
    """Plain lines; with journald (JOURNAL_STREAM set) each gets its <priority> prefix."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self) -> None:
        super().__init__("%(name)s: %(message)s")
        self.journal = bool(os.environ.get("JOURNAL_STREAM"))

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self.journal:
            return f"<{self.PRIORITY.get(record.levelno, 6)}>{line}"
        return f"{time.strftime('%H:%M:%S')} {record.levelname.lower()} {line}"


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JournalFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class Daemon:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stages: list[StageServer] = []
        self.head = None
        self.started = time.time()
        self.draining = False
        self.topology = None

    def _stage_indices(self) -> list[int]:
        n = len(self.topology.stages)
        if self.args.stage in (None, "all"):
            return list(range(n))
        try:
            k = int(self.args.stage)
        except ValueError:
            raise SystemExit(f"skippyd: --stage must be a number or 'all', got {self.args.stage!r}")
        if not 0 <= k < n:
            raise SystemExit(f"skippyd: --stage {k} is outside the topology's {n} stages (0..{n - 1})")
        return [k]

    def _stages_on_this_host(self) -> int:
        """Stages of the topology bound to this host's addresses (loopback counts as this host)."""
        import socket

        mine = {"127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()}
        try:
            mine.add(socket.gethostbyname(socket.gethostname()))
        except OSError:
            pass
        ours = self.topology.stage(self._stage_indices()[0]).host
        return sum(1 for s in self.topology.stages if s.host in mine or s.host == ours)

    def _config(self, n_local: int) -> StageConfig:
        a = self.args
        # llama.cpp's threads spin at barriers: stages sharing a host split its cores between them
        # (two 2-thread stages on 2 cores run at a third of their speed; see BENCHMARKS.md)
        threads = a.threads or max(1, (os.cpu_count() or 2) // max(1, n_local))
        cfg = StageConfig(n_ctx_per_seq=a.ctx, lanes=a.lanes, n_batch=a.batch, n_threads=threads,
                          credit_limit=a.credit, reply_timeout_s=a.reply_timeout)
        if a.listen:
            cfg.listen_host, cfg.listen_port = a.listen
        return cfg

    async def run(self) -> None:
        from skippyd.head.node import HeadNode
        from skippyd.topology import Topology, TopologyError

        a = self.args
        if (a.topology is None) == (a.model is None):
            raise SystemExit("skippyd: give either --topology FILE (with --stage) or --model FILE")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, nursery.cancel_scope)
            if a.model is not None:
                cfg = self._config(1)
                self.head = await nursery.start(HeadNode(cfg, model_path=a.model, prefill_chunk=a.prefill_chunk,
                                                         receipts_file=a.receipts).run)
            else:
                try:
                    self.topology = Topology.load(a.topology)
                except (TopologyError, OSError) as exc:
                    raise SystemExit(f"skippyd: {exc}")
                indices = self._stage_indices()
                cfg = self._config(self._stages_on_this_host())
                # downstream stages first, so the head's lanes find them listening
                for k in sorted(indices, reverse=True):
                    if k == 0:
                        self.head = await nursery.start(HeadNode(cfg, topology=self.topology,
                                                                 prefill_chunk=a.prefill_chunk,
                                                                 receipts_file=a.receipts).run)
                    else:
                        self.stages.append(await nursery.start(StageServer(self.topology, k, cfg).run))
            if not a.no_control:
                from skippyd.control.server import ControlServer

                control = ControlServer(self, *a.control, token_file=a.control_token_file)
                await nursery.start(control.run)
            _notify("READY=1")
            log.info("ready: %s", self.describe_role())

    def describe_role(self) -> str:
        parts = []
        if self.head is not None:
            parts.append("head")
        parts += [f"stage {s.index}" for s in self.stages]
        return ", ".join(parts)

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("received %s: draining", signal.Signals(signum).name)
                _notify("STOPPING=1")
                await self.drain(grace_s=30.0)
                scope.cancel()
                return

    async def drain(self, grace_s: float) -> None:
        """Stop taking new generations, let running ones finish up to `grace_s`."""
        self.draining = True
        if self.head is not None and self.head.pool is not None:
            await self.head.pool.drain()
        if self.head is not None and self.head.engine is not None:
            with trio.move_on_after(grace_s):
                while self.head.engine.live:
                    await trio.sleep(0.05)

    async def status(self) -> dict:
        """Role, model, stages and their reachability, uptime, load."""
        snap = self.snapshot()
        head = self.head
        if head is not None and head.model is not None:
            snap["model"] = {"name": head.model.name, "path": str(head.model_path),
                             "architecture": head.model.architecture, "n_layer_total": head.model.stage.n_layer_total}
            snap["load"] = {"live_generations": len(head.engine.live) if head.engine else 0,
                            "totals": head.engine.totals if head.engine else {}}
        if self.topology is not None:
            stages = []
            for spec in self.topology.stages:
                stages.append({"index": spec.index, "address": f"{spec.host}:{spec.port}",
                               "layers": [spec.layer_start, spec.layer_end],
                               "local": any(s.index == spec.index for s in self.stages) or (spec.index == 0 and head is not None),
                               "reachable": spec.index == 0 or await _reachable(spec.host, spec.port)})
            snap["topology"] = {"model": self.topology.model_name, "source_sha256": self.topology.source_sha256,
                                "protocol_version": PROTOCOL_VERSION, "stages": stages}
        else:
            snap["topology"] = None
        return snap

    def snapshot(self) -> dict:
        return {
            "role": self.describe_role(),
            "uptime_s": round(time.time() - self.started, 1),
            "draining": self.draining,
            "head": self.head.snapshot() if self.head else None,
            "stages": [s.snapshot() for s in self.stages],
        }


async def _reachable(host: str, port: int) -> bool:
    try:
        with trio.fail_after(1.0):
            stream = await trio.open_tcp_stream(host, port)
    except (OSError, trio.TooSlowError):
        return False
    await trio.aclose_forcefully(stream)
    return True


def _notify(state: str) -> None:
    """sd_notify without dependencies; a no-op without NOTIFY_SOCKET, never raises."""
    import socket

    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(state.encode(), addr)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        trio.run(Daemon(args).run)
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
    except (OSError, ValueError, LlamaError, TopologyError) as exc:  # startup failures: one clear line
        log.error("fatal: %s", exc)
        return 1
    except BaseExceptionGroup as group:
        expected, other = group.split((OSError, ValueError, LlamaError, TopologyError))
        if other is None:
            log.error("fatal: %s", "; ".join(str(e) for e in _leaves(expected)))
            return 1
        log.critical("internal error (a bug; please report it)", exc_info=group)
        return 70
    return 0


def _leaves(group: BaseExceptionGroup):
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


if __name__ == "__main__":
    sys.exit(main())
