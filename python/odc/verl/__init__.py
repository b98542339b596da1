"""odc.verl: odc as a verl training backend (`actor_rollout_ref.actor.strategy=odc`).

verl imports every entry point of the group `verl.plugins` when `import verl` runs; odc's points at
`odc.verl.plugin`, whose import calls `register()`. Nothing here imports verl until `register()`
or `check()` is called, so `import odc` and `import odc.verl` work where verl is not installed.
docs/verl.md says what the backend supports and what was tested.
"""

from __future__ import annotations

import logging

BACKEND = "odc"  # the strategy name verl's configs select the engine with
MODEL_TYPE = "language_model"
# EngineRegistry keys engines by device; "cpu" is there for the CPU tests (gloo + host transport).
DEVICES = ["cuda", "cpu"]
VERL_VERSION = "0.9.1"  # the verl release the engine was written and tested against

logger = logging.getLogger("odc.verl")


def register() -> type:
    """Adds engine `odc` to verl's EngineRegistry (idempotent) and returns its class: for model
    type `language_model` (the actor, SFT), and for `value_model` a class that refuses at
    initialization (the critic is not supported yet). Raises ImportError where verl is missing."""
    import verl
    from verl.workers.engine.base import EngineRegistry

    from .engine import OdcEngineWithLMHead, OdcEngineWithValueHead

    if verl.__version__ != VERL_VERSION:
        logger.warning(
            "odc.verl was written and tested against verl %s, found %s: the odc engine copies "
            "parts of verl's FSDP engine (python/odc/verl/engine.py, V1-V5); check them",
            VERL_VERSION,
            verl.__version__,
        )

    for model_type, engine in (
        (MODEL_TYPE, OdcEngineWithLMHead),
        ("value_model", OdcEngineWithValueHead),
    ):
        # EngineRegistry._engines is private (0.9.1: model type -> backend -> device -> class);
        # read only to make register() idempotent: EngineRegistry.register asserts on a repeat.
        known = EngineRegistry._engines.get(model_type, {}).get(BACKEND, {})
        missing = [device for device in DEVICES if known.get(device) is not engine]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=BACKEND, device=missing)(engine)
    return OdcEngineWithLMHead


def check() -> tuple:
    """(ok, lines): whether `import verl` finds the backend through its entry point, and why not.
    Imports verl (so its plugin loading runs as it would in a job)."""
    lines = []
    try:
        import verl
    except Exception as error:  # what a job would meet: say it, with the exception
        return False, [f"verl cannot be imported: {type(error).__name__}: {error}"]
    lines.append(f"verl {verl.__version__} imported (odc.verl was written for {VERL_VERSION})")
    from importlib.metadata import entry_points

    points = [p for p in entry_points(group="verl.plugins") if p.name == BACKEND]
    if not points:
        lines.append(
            "no 'odc' entry point in group 'verl.plugins': odc is not installed as a package "
            "(pip install -e . in the odc checkout), or an older odc without it is"
        )
    else:
        lines.append(f"entry point: {points[0].name} = {points[0].value}")
    from verl.workers.engine.base import EngineRegistry

    registered = EngineRegistry._engines.get(MODEL_TYPE, {}).get(BACKEND)
    if not registered:
        lines.append(
            "EngineRegistry has no backend 'odc': the plugin did not load "
            "(VERL_USE_EXTERNAL_PLUGINS=none, or a name list without 'odc'?, or an import error "
            "logged above by odc.verl)"
        )
        return False, lines
    devices = ", ".join(sorted(str(key) for key in registered))
    engine = next(iter(registered.values()))
    lines.append(f"EngineRegistry: backend 'odc' for {MODEL_TYPE} on {devices}: {engine.__name__}")
    return True, lines
