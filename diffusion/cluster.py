"""Starting Ray: one quiet way for every stage (download, convert, online training)."""

from __future__ import annotations

import os
import socket
import threading

from diffusion import cpus
from diffusion.errors import UserError

AUTH_MODE = "RAY_AUTH_MODE"  # Ray 2.60: "token" sends the token in ~/.ray/auth_token (or RAY_AUTH_TOKEN)
# How long joining an explicit address waits for its host to be found and its port to take a TCP connection
# (a head's port answers in milliseconds; Ray 2.60's ray.init retries an address where nothing answers forever)
ANSWER_WAIT_S = 5.0


def init_ray(address: str | None = None, log_to_driver: bool = False):
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``; a new local one if neither), quietly.

    Ray's own loggers show warnings and errors only (``logging_level``); workers' output stays in their
    log files (``log_to_driver=False``). Two messages are dropped at their source: Ray 2.60's note, on
    every new local cluster, that it turned on token authentication (its default; the token is still
    made and used), and Ray Data's INFO lines on the console (execution plans and, when stdout is not a
    terminal, a 15-line progress block every 10 s). Ray Data's warnings still print, and its full log
    is still written to the session's ``logs/ray-data/ray-data.log``. Online mode uses this too.
    """
    import logging

    import ray
    if not ray.is_initialized():
        auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
        if not any(getattr(f, "_drops_token_note", False) for f in auth.filters):
            def drop_token_note(record: logging.LogRecord) -> bool:
                return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")
            drop_token_note._drops_token_note = True
            auth.addFilter(drop_token_note)
        address = address or os.environ.get("RAY_ADDRESS")
        joins = _joins(address)
        if joins:  # an address where nothing answers: one line within seconds (ray.init waits forever)
            _check_answers(address, "RAY_ADDRESS" if address == os.environ.get("RAY_ADDRESS") else "--address")
            _token_for_cluster()
        try:
            ray.init(address=address, log_to_driver=log_to_driver, num_cpus=_local_cpus(address),
                     include_dashboard=False, logging_level=logging.WARNING)
        except Exception as e:  # Ray's start and connect failures: one line saying what to do
            raise _start_failure(e, address if joins else None) from None
    import ray.data  # configures the "ray.data" logger's handlers on import
    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console" and handler.level < logging.WARNING:
            handler.setLevel(logging.WARNING)
    return ray


def _local_cpus(address: str | None) -> int | None:
    """``num_cpus`` when ``ray.init(address)`` starts a new local cluster: the CPUs this process may use
    (:func:`diffusion.cpus.ray_cpus`: its affinity mask and cgroup quota, which Ray alone half-counts);
    None when it joins a running cluster (which has its own) or ``DIFFUSION_CPUS=off``."""
    return None if _joins(address) else cpus.ray_cpus()


def _joins(address: str | None) -> bool:
    """Whether ``ray.init(address)`` joins a running cluster (not a new local one)."""
    from ray._private.services import canonicalize_bootstrap_address
    try:
        return canonicalize_bootstrap_address(address) is not None
    except Exception:  # no cluster where the address says: ray.init reports that itself
        return bool(address)


def _check_answers(address: str, source: str = "RAY_ADDRESS", wait_s: float = ANSWER_WAIT_S) -> None:
    """Raise a one-line :class:`~diffusion.errors.UserError` unless something takes a TCP connection at the
    explicit ``address`` (``host:port`` or ``ray://host:port``) within ``wait_s`` seconds, host name lookup
    included: Ray 2.60's ``ray.init`` waits forever on an address where no cluster answers (a warning every
    ~40 s). The port probed is the one Ray connects to (``127.0.0.1``/``localhost`` become this host's
    address, as Ray makes them). ``auto``, ``local`` and no address (a new local cluster) are not checked;
    ``source`` names where the address came from (``RAY_ADDRESS`` or ``--address``)."""
    if not address or address in ("auto", "local"):
        return
    from ray._common.network_utils import parse_address
    client = address.startswith("ray://")
    target = address[len("ray://"):] if client else address
    parsed = parse_address(target)
    if client and parsed is None:
        return  # ray://HOST: Ray Client's default port, its own connection retries
    if parsed is None or not str(parsed[1]).isdigit():
        raise UserError(f"{source}={address}: not a Ray cluster address; give the head's HOST:PORT "
                        f"(e.g. HEAD:6379, the port of its ray start --head --port)")
    host, port = parsed[0], int(parsed[1])
    if not client:  # where ray.init connects: a loopback name becomes this host's address
        from ray._private.services import resolve_ip_for_localhost
        try:
            host = resolve_ip_for_localhost(host)
        except Exception:
            pass
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=wait_s).close()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)
    # in a thread: the name lookup has no timeout of its own
    probe = threading.Thread(target=connect, name="ray-address-probe", daemon=True)
    probe.start()
    probe.join(wait_s + 1)
    if outcome and outcome[0] is None:
        return
    error = outcome[0] if outcome else None
    if isinstance(error, socket.gaierror):
        why = f"host {host} not found"
    elif isinstance(error, ConnectionRefusedError):
        why = "connection refused"
    elif error is None or isinstance(error, (TimeoutError, socket.timeout)):
        why = f"no answer within {wait_s:g} s"
    else:
        why = (str(error).splitlines() or [type(error).__name__])[0][:160]
    tried = f"{host}:{port}"
    where = "" if tried == target else f", tried {tried}"
    start = "the Ray Client server (ray start --head runs one on port 10001)" if client else \
        f"ray start --head --port={port}"
    raise UserError(f"no Ray cluster answers at {address} ({source}{where}: {why}): is {start} running there? "
                    f"check the host, that the port is open to this machine, and {source}")


def _token_for_cluster() -> None:
    """Joining a running cluster: send this host's Ray token when it has one and ``RAY_AUTH_MODE`` is unset.

    Ray 2.60 writes ``~/.ray/auth_token`` at any local ``ray.init()`` (an earlier conversion, the demo), and
    ``ray start --head`` then turns token authentication on for its cluster; a driver joining it does not
    send the token unless ``RAY_AUTH_MODE=token`` (it fails with ~30 lines of ``InvalidAuthToken``). A head
    without authentication ignores the token. ``RAY_AUTH_MODE`` set by the user is left as it is."""
    if os.environ.get(AUTH_MODE):
        return
    # where Ray 2.60 looks for the token (not through its loader, which caches the mode it first sees)
    paths = [os.environ.get("RAY_AUTH_TOKEN_PATH"), os.path.join(os.path.expanduser("~"), ".ray", "auth_token")]
    if not (os.environ.get("RAY_AUTH_TOKEN") or any(p and os.path.isfile(p) for p in paths)):
        return
    try:  # Ray's own switch: the variable, and its cached config refreshed (read when ray was imported)
        from ray._private.authentication.authentication_token_setup import _enable_token_auth
        _enable_token_auth()
    except ImportError:
        os.environ[AUTH_MODE] = "token"


def _start_failure(error: Exception, address: str | None) -> Exception:
    """``ray.init``'s ``error`` as one line (a :class:`~diffusion.errors.UserError`) where it is one the user
    can act on: a local start that timed out (a busy machine: retry), a cluster that refused this
    process's token, or no cluster at ``address``; anything else as it was."""
    text = str(error)
    if address is None and ("timed out" in text.lower() or isinstance(error, TimeoutError)):
        return UserError(f"Ray's local start timed out ({text.splitlines()[0][:160]}): the machine is busy; "
                         f"re-run the same command (it resumes where it stopped)")
    if address is not None and (type(error).__name__ == "AuthenticationError" or "auth" in text.lower()):
        return UserError(f"the Ray cluster at {address} refused this process's token: copy the head's "
                         f"~/.ray/auth_token to this host (or set RAY_AUTH_TOKEN) and set {AUTH_MODE}=token")
    if address is not None and isinstance(error, ConnectionError):
        return UserError(f"no Ray cluster answers at {address} ({text.splitlines()[0][:160]}): start one with "
                         f"ray start --head, or check the address and its port")
    return error
