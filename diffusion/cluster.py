"""Starting Ray: one quiet way for every stage (download, convert, online training)."""

from __future__ import annotations

import os

from diffusion import cpus


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
        ray.init(address=address, log_to_driver=log_to_driver, num_cpus=_local_cpus(address),
                 include_dashboard=False, logging_level=logging.WARNING)
    import ray.data  # configures the "ray.data" logger's handlers on import
    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console" and handler.level < logging.WARNING:
            handler.setLevel(logging.WARNING)
    return ray


def _local_cpus(address: str | None) -> int | None:
    """``num_cpus`` when ``ray.init(address)`` starts a new local cluster: the CPUs this process may use
    (:func:`diffusion.cpus.ray_cpus`: its affinity mask and cgroup quota, which Ray alone half-counts);
    None when it joins a running cluster (which has its own) or ``DIFFUSION_CPUS=off``."""
    from ray._private.services import canonicalize_bootstrap_address
    try:
        joins = canonicalize_bootstrap_address(address) is not None
    except Exception:  # no cluster where the address says: ray.init reports that itself
        return None
    return None if joins else cpus.ray_cpus()
