"""A command's ``cli.run`` entry in the test's own process, seen as a subprocess would see it: for tests whose
point is the command's refusal, not its process (a subprocess of generate, export or evaluate pays ~4 s of torch and
diffusers imports, one of run.py ~15 s of Composer's, for a refusal that takes milliseconds)."""

import os
import subprocess
import warnings


def run_entry(capfd, main, prog: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cli.run(main, prog, ARGS)`` as the command's ``__main__`` runs it: its exit status and what reached
    stdout/stderr, the file descriptors included (capfd). Warnings it raises are on its stderr as Python's default
    filters show them in a new process (pytest would only record them). ``os.environ`` (with ``env`` set, and no
    ``DIFFUSION_DEBUG``) is restored after."""
    from diffusion import cli
    capfd.readouterr()
    environ = dict(os.environ)
    os.environ.pop("DIFFUSION_DEBUG", None)
    os.environ.update(env or {})
    code = 0
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        for quiet in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", quiet)  # Python's default filters outside __main__
        try:
            cli.run(main, prog, [str(a) for a in args])
        except SystemExit as exited:
            code = exited.code if isinstance(exited.code, int) else (0 if exited.code is None else 1)
        finally:
            os.environ.clear()
            os.environ.update(environ)
    printed = capfd.readouterr()
    err = printed.err + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in raised)
    return subprocess.CompletedProcess([prog, *args], code, printed.out, err)
