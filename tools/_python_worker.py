"""The python tool's interpreter process (standard library only; run by path).

Protocol: one JSON request per line on stdin ``{"code": str, "max_output": int}``, one JSON
answer per line on the original stdout ``{"stdout", "stderr", "value", "error"}``. The
model's code sees /dev/null as stdin and writes to fds 1 and 2, which point at temp files,
so output of subprocesses and C extensions is captured as well. Variables live in one
namespace for the life of the process; the server kills the process group on a timeout.
"""

import ast
import builtins
import json
import linecache
import os
import sys
import tempfile
import traceback

WORKER_FILE = os.path.abspath(__file__)


def _capture_file(name: str):
    """Where fds 1 and 2 point: a memory file where the platform has one, so a full /tmp (the
    model's code may fill it; locally it shares a tmpfs with the workdir) does not stop the capture."""
    if hasattr(os, "memfd_create"):
        try:
            return os.fdopen(os.memfd_create(f"python-tool-{name}", os.MFD_CLOEXEC), "w+b")
        except OSError:
            pass
    return tempfile.TemporaryFile()


def _read_capture(f, limit: int) -> str:
    size = os.fstat(f.fileno()).st_size
    os.lseek(f.fileno(), 0, os.SEEK_SET)
    data = os.read(f.fileno(), min(size, limit)) if size else b""
    os.ftruncate(f.fileno(), 0)
    os.lseek(f.fileno(), 0, os.SEEK_SET)
    text = data.decode("utf-8", errors="replace")
    if size > limit:
        text += f"\n[... {size - limit} more bytes of output truncated ...]"
    return text


def _format_exc(exc: BaseException) -> str:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == WORKER_FILE:
        tb = tb.tb_next  # hide the worker's own frames
    return "".join(traceback.format_exception(type(exc), exc, tb))


def main() -> None:
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out, err = _capture_file("stdout"), _capture_file("stderr")
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.argv = [""]
    # like `python -c`: the workdir first, then PYTHONPATH, added now that the start is over (the
    # interpreter runs isolated, -I: nothing the code wrote ran while it started)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [os.getcwd(), *extra]
    ns = {"__name__": "__main__", "__builtins__": builtins}
    n = 0
    while True:
        line = proto_in.readline()
        if not line:
            return
        req = json.loads(line)
        limit = int(req.get("max_output", 1 << 20))
        n += 1
        fname = f"<cell {n}>"
        code = req["code"]
        linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
        value, error = None, None
        try:
            tree = ast.parse(code, fname, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, fname, "exec"), ns)
            if last is not None:
                result = eval(compile(last, fname, "eval"), ns)
                if result is not None:
                    ns["_"] = result
                    value = repr(result)
                    if len(value) > limit:
                        value = value[:limit] + f"... [repr truncated: {len(value)} characters]"
        except SystemExit as e:
            error = f"SystemExit: {e.code!r} (the interpreter keeps running)"
        except BaseException as e:  # the model's error, shown as Python would
            try:
                sys.stderr.write(_format_exc(e))
            except Exception:  # noqa: BLE001 - the capture itself failed: the error line still says it
                pass
            error = f"{type(e).__name__}: {e}"[:500]
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        answer = {"stdout": _read_capture(out, limit), "stderr": _read_capture(err, limit),
                  "value": value, "error": error}
        proto_out.write(json.dumps(answer).encode() + b"\n")
        proto_out.flush()


if __name__ == "__main__":
    main()
