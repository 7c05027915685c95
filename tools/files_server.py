"""MCP tool server `files`: read, write, list and edit files in the workdir.

    python -m agentrl.tools.files_server [--workdir DIR]

Tools: ``read_file(path, start_line=1, end_line=None)``, ``write_file(path, content)``,
``list_files(path=".", recursive=False)``, ``edit_file(path, old_string, new_string,
replace_all=False)`` (replace one exact, unique occurrence). Paths are relative to the
workdir (absolute paths inside it are accepted); anything resolving outside it, symlinks
included, is refused. Errors are addressed to the model: they say what went wrong and
how to fix the call.
"""

from __future__ import annotations

import errno
import functools
import os
import stat
from pathlib import Path

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from agentrl.tools._common import clip, new_server, resolve_workdir, serve

MAX_LIST = 1000


class Workdir:
    def __init__(self, root: Path | str | None = None):
        self.root = resolve_workdir(root)

    def resolve(self, path: str, *, must_exist: bool = False) -> Path:
        if not isinstance(path, str) or not path.strip():
            raise ToolError("path is empty: give a file path relative to the working directory")
        p = Path(path.strip())
        full = (p if p.is_absolute() else self.root / p).resolve()
        if full != self.root and not full.is_relative_to(self.root):
            raise ToolError(f"path {path!r} is outside the working directory {self.root}; use a path inside it "
                            "(relative paths are relative to it)")
        if must_exist and not full.exists():
            raise ToolError(f"{path!r} does not exist in {self.root}" + self._siblings_hint(full))
        return full

    def _siblings_hint(self, full: Path) -> str:
        parent = full.parent
        if not parent.is_dir():
            return f" (its folder {self.rel(parent)!r} does not exist either)"
        names = sorted(x.name for x in parent.iterdir())[:20]
        return f". Files in {self.rel(parent)!r}: {', '.join(names) or '(none)'}"

    def rel(self, full: Path) -> str:
        r = os.path.relpath(full, self.root)
        return "." if r == "." else r

    def open_checked(self, full: Path, path: str, flags: int) -> int:
        """Open `full` and check what was opened, not only what the path was when resolved: a
        process of the agent (the python tool's interpreter lives between calls) may swap the
        file, or a folder above it, for a symlink in between (to /proc/self/fd/1: this server's
        own channel to the host). A regular file inside the workdir, or ToolError."""
        fd = os.open(full, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            mode = os.fstat(fd).st_mode
            try:
                real = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:  # no /proc (not Linux): the check at resolve() is all there is
                real = full
            if stat.S_ISDIR(mode):
                raise ToolError(f"{path!r} is a directory; use list_files to see what it holds")
            if not stat.S_ISREG(mode):  # a FIFO or device would hang the server
                raise ToolError(f"{path!r} is not a regular file")
            if not real.is_relative_to(self.root):
                raise ToolError(f"path {path!r} is outside the working directory {self.root}")
            os.set_blocking(fd, True)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read_text(self, full: Path, path: str) -> str:
        if full.is_dir():
            raise ToolError(f"{path!r} is a directory; use list_files to see what it holds")
        try:
            fd = self.open_checked(full, path, os.O_RDONLY)
        except IsADirectoryError:
            raise ToolError(f"{path!r} is a directory; use list_files to see what it holds") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink swapped in after resolve()
                raise ToolError(f"{path!r} is not a regular file") from None
            raise
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            raise ToolError(f"{path!r} is a binary file ({len(data)} bytes); it cannot be shown as text")
        return data.decode("utf-8", errors="replace")

    def write_text(self, full: Path, path: str, text: str) -> None:
        try:
            fd = self.open_checked(full, path, os.O_WRONLY | os.O_CREAT)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink swapped in after resolve()
                raise ToolError(f"{path!r} is not a regular file") from None
            raise
        with os.fdopen(fd, "wb") as f:
            f.truncate(0)
            f.write(text.encode("utf-8"))


def _os_errors(fn):
    """OSErrors (permissions, full disk...) become errors the model can read."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            where = f" ({e.filename})" if e.filename else ""
            raise ToolError(f"{type(e).__name__}: {e.strerror or e}{where}") from None
    return wrapper


def add_file_tools(server: MCPServer, workdir: Path | str | None = None, max_output: int = 64 * 1024) -> Workdir:
    wd = Workdir(workdir)

    @server.tool(structured_output=False)
    @_os_errors
    def read_file(path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Read a text file in the working directory. Give start_line / end_line (1-based, inclusive)
        to read part of a long file."""
        full = wd.resolve(path, must_exist=True)
        text = wd.read_text(full, path)
        if start_line == 1 and end_line is None:
            return clip(text, max_output, "; read it in parts with start_line and end_line") if text else "(empty file)"
        lines = text.splitlines(keepends=True)
        if start_line < 1 or start_line > max(len(lines), 1):
            raise ToolError(f"start_line {start_line} is out of range: {path!r} has {len(lines)} lines")
        end = len(lines) if end_line is None else min(end_line, len(lines))
        if end < start_line:
            raise ToolError(f"end_line {end_line} is before start_line {start_line}")
        body = "".join(lines[start_line - 1:end])
        return clip(f"[lines {start_line}-{end} of {len(lines)}]\n{body}", max_output)

    @server.tool(structured_output=False)
    @_os_errors
    def write_file(path: str, content: str) -> str:
        """Create or overwrite a text file in the working directory (parent folders are created)."""
        full = wd.resolve(path)
        if full.is_dir():
            raise ToolError(f"{path!r} is a directory; give a file path")
        if full.exists() and not full.is_file():  # a FIFO or device would hang the server
            raise ToolError(f"{path!r} is not a regular file")
        full.parent.mkdir(parents=True, exist_ok=True)
        wd.write_text(full, path, content)
        return f"wrote {len(content.encode())} bytes ({content.count(chr(10)) + bool(content and not content.endswith(chr(10)))} lines) to {wd.rel(full)}"

    @server.tool(structured_output=False)
    @_os_errors
    def list_files(path: str = ".", recursive: bool = False) -> str:
        """List a folder of the working directory: one entry per line, folders end with '/', files
        show their size in bytes."""
        full = wd.resolve(path, must_exist=True)
        if not full.is_dir():
            raise ToolError(f"{path!r} is a file, not a folder; use read_file to read it")
        entries = sorted(full.rglob("*") if recursive else full.iterdir())
        lines = []
        for e in entries[:MAX_LIST]:
            name = os.path.relpath(e, full)
            lines.append(f"{name}/" if e.is_dir() else f"{name}  ({e.stat().st_size if e.exists() else '?'} bytes)")
        if len(entries) > MAX_LIST:
            lines.append(f"[... {len(entries) - MAX_LIST} more entries not shown]")
        return "\n".join(lines) if lines else f"{wd.rel(full)} is empty"

    @server.tool(structured_output=False)
    @_os_errors
    def edit_file(path: str, old_string: str, new_string: str, replace_all: bool = False) -> str:
        """Edit a text file by replacing an exact string. old_string must appear exactly once (copy it
        from the file, whitespace included, with enough surrounding lines to be unique), unless
        replace_all is true."""
        full = wd.resolve(path, must_exist=True)
        text = wd.read_text(full, path)
        if old_string == "":
            raise ToolError("old_string is empty; give the exact text to replace (use write_file to create a file)")
        if old_string == new_string:
            raise ToolError("old_string and new_string are the same: nothing to change")
        count = text.count(old_string)
        if count == 0:
            hint = ""
            if text.count(old_string.strip()) and old_string.strip():
                hint = " (it appears with different leading/trailing whitespace)"
            raise ToolError(f"old_string not found in {wd.rel(full)}{hint}. Read the file and copy the exact text, "
                            "including whitespace and indentation.")
        if count > 1 and not replace_all:
            raise ToolError(f"old_string found {count} times in {wd.rel(full)}; give more context (surrounding "
                            "lines) so it matches exactly once, or set replace_all to true.")
        new_text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
        wd.write_text(full, path, new_text)
        at = text.index(old_string)
        line = text.count("\n", 0, at) + 1
        return f"edited {wd.rel(full)}: replaced {count if replace_all else 1} occurrence(s) (first at line {line})"

    return wd


def build_server(workdir: Path | str | None = None, max_output: int = 64 * 1024, **_) -> MCPServer:
    server = new_server("files", "Read, write, list and edit files in the task's working directory.")
    add_file_tools(server, workdir, max_output=max_output)
    return server


def main(argv: list[str] | None = None) -> None:
    serve("agentrl.tools.files_server", __doc__, lambda args, workdir, **limits: build_server(workdir, **limits), argv)


if __name__ == "__main__":
    main()
