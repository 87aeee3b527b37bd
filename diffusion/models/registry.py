"""Parts found by name: every module of a package lists what it offers in one dict, so a new part is one
new file (``OBJECTIVES`` in :mod:`diffusion.models.objectives`, ``DENOISERS`` in
:mod:`diffusion.models.denoisers`)."""

from __future__ import annotations

import importlib
import pkgutil


def collect(package_name: str, package_path, attribute: str) -> dict:
    """``{name: part}`` merged from the ``attribute`` dict of every module of the package (``base`` aside)."""
    found = {}
    for module in pkgutil.iter_modules(package_path):
        if module.name != "base":
            found.update(getattr(importlib.import_module(f"{package_name}.{module.name}"), attribute, {}))
    return found
