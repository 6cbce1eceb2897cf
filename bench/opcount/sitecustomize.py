"""Loaded by the daemons that bench/opcodes.py starts (it puts this folder on their PYTHONPATH): counts the
bytecode instructions the main thread runs, per function, between SIGUSR1 (start) and SIGUSR2 (stop and
write the counts to $SKIPPY_OPCOUNT_DIR/ops-PID.json). Nothing happens without that variable."""

import os

if os.environ.get("SKIPPY_OPCOUNT_DIR"):
    import collections
    import json
    import signal
    import sys

    _counts: collections.Counter = collections.Counter()

    def _name(code) -> str:
        path = code.co_filename.split("site-packages/")[-1]
        for marker in ("/skippyd/", "/lib/python3"):
            if marker in path:
                path = path[path.index(marker) + 1:]
        return f"{path}:{code.co_firstlineno} {code.co_name}"

    def _tracer(frame, event, _arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            _counts[frame.f_code] += 1
        return _tracer

    def _frames(frame):
        while frame is not None:
            yield frame
            frame = frame.f_back

    def _start(_sig, frame) -> None:
        _counts.clear()
        for f in _frames(frame):  # the frames running now (trio's loop among them) are counted too
            f.f_trace, f.f_trace_opcodes = _tracer, True
        sys.settrace(_tracer)

    def _stop(_sig, frame) -> None:
        sys.settrace(None)
        for f in _frames(frame):
            f.f_trace = None
        totals: collections.Counter = collections.Counter()
        for code, n in _counts.items():
            totals[_name(code)] += n
        path = os.path.join(os.environ["SKIPPY_OPCOUNT_DIR"], f"ops-{os.getpid()}.json")
        with open(path, "w") as out:
            json.dump(totals, out)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
