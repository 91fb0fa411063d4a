"""Run a training script as ``__main__`` as ``python -u script.py`` would, and end the process
as CPython would, minus the interpreter teardown.

Why not let the interpreter finalize: a gloo worker thread can drop the last reference to a
Python-owned tensor (the finished all-reduce's input) just after the main thread started
finalizing. CPython then ends that thread with ``pthread_exit`` inside a C++ ``noexcept``
destructor and the process dies of SIGABRT ("terminate called without an active exception")
instead of exiting with the script's code. Seen here under CPU load in fresh processes too.

So a worker that runs here ends with the steps a script can observe (non-daemon threads joined,
``atexit`` handlers run, every open Python file flushed, the uncaught exception printed by
``sys.excepthook``) and then ``os._exit`` with the code CPython would have used.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib.machinery
import io
import os
import runpy
import signal
import sys
import threading
import types
import zipfile
from typing import NoReturn

EXIT_UNCAUGHT = 1


def run_as_main(argv: list[str], module: bool) -> NoReturn:
    """Run ``argv[0]`` (a script path, or a module name when ``module``) with ``argv[1:]``."""
    error: BaseException | None = None
    try:
        if module:
            sys.argv = list(argv)
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[0], alter_argv=True)  # what `python -m` calls
        else:
            path = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(path)
            _run_path(path)
    except BaseException as e:  # the script's own way out: returned to CPython's rules below
        error = e
    exit_like_python(error)


def _run_path(path: str) -> None:
    """Execute a script file in a fresh ``__main__`` module, as CPython's run_file does."""
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(path, run_name="__main__")  # a directory or zip with __main__.py
        return
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__cached__ = None
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    with io.open_code(path) as f:
        source = f.read()
    # dont_inherit: this module's `from __future__` flags must not leak into the script.
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def exit_code(error: BaseException | None) -> int:
    """The status CPython exits with after the main module ended with ``error``."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):
        code = error.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        return EXIT_UNCAUGHT  # CPython prints a non-int code to stderr and exits 1
    return EXIT_UNCAUGHT


def exit_like_python(error: BaseException | None) -> NoReturn:
    """Report ``error`` as CPython would, run the exit steps, and leave with its status."""
    code = exit_code(error)
    if isinstance(error, SystemExit):
        if error.code is not None and not isinstance(error.code, int):
            _print_stderr(str(error.code))
    elif error is not None:
        _report_uncaught(error)
    _shutdown_threads()
    _run_atexit()
    _flush_open_files()
    if isinstance(error, KeyboardInterrupt):
        # CPython ends an unhandled Ctrl-C by re-raising SIGINT, so the parent sees the signal.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    os._exit(code)


def _report_uncaught(error: BaseException) -> None:
    """sys.excepthook on the exception, with this module's frames cut off the traceback."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    error = error.with_traceback(tb)  # hooks may read it from the exception itself
    try:
        sys.excepthook(type(error), error, tb)
    except BaseException:  # as CPython: a failing hook must not hide the exit code
        pass


def _print_stderr(text: str) -> None:
    try:
        print(text, file=sys.stderr)
    except Exception:
        pass


def _shutdown_threads() -> None:
    """Join non-daemon threads, as Py_FinalizeEx does before anything else."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except BaseException:
            pass


def _run_atexit() -> None:
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass


def _flush_open_files() -> None:
    """Flush every open Python file, as their destructors would during interpreter teardown."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        _flush(stream)
    # type(), not isinstance(): an object's __class__ may be a property with side effects.
    files = [obj for obj in gc.get_objects() if issubclass(type(obj), io.IOBase)]
    # Text layers first: flushing one pushes its text into the binary buffer below it.
    files.sort(key=lambda f: not isinstance(f, io.TextIOBase))
    for f in files:
        _flush(f)


def _flush(stream: object) -> None:
    try:
        if stream is not None and not stream.closed:  # type: ignore[attr-defined]
            stream.flush()  # type: ignore[attr-defined]
    except Exception:  # detached, broken pipe, read-only: nothing to flush
        pass
