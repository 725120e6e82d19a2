"""The audit: the deployment checklist, offline (runner.py) and from outside (endpoint/)."""

from . import registry  # noqa: F401 - the built-in checks, registered before any audit runs
