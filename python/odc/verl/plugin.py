"""The `verl.plugins` entry point: importing this module registers engine `odc` with verl.

verl 0.9.1 loads entry points inside a try/except that logs failures at DEBUG level only, so a
broken install would look like "Unknown backend: odc" much later. Any failure here is therefore
logged at ERROR level with its traceback (and re-raised, for whoever imports this directly).
"""

from . import logger, register

try:
    register()
except Exception:
    logger.error(
        "odc.verl: registering the verl backend 'odc' failed; a job selecting strategy=odc will "
        "fail with 'Unknown backend'. Run `python -m odc.verl check` for details.",
        exc_info=True,
    )
    raise
