"""Count XLA compilations (jax.monitoring's backend-compile events), e.g. to assert no recompilation
after the first training steps."""
from __future__ import annotations

import jax

_EVENT = "/jax/core/compile/backend_compile_duration"
_count = 0
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    global _count
    if event == _EVENT:
        _count += 1


def install() -> None:
    """Register the listener once per process (jax.monitoring has no unregister)."""
    global _installed
    if not _installed:
        jax.monitoring.register_event_duration_secs_listener(_listener)
        _installed = True


def compilations() -> int:
    """Backend compilations seen since `install()` (jit programs and eager ops alike). The event wraps
    compiler.compile_or_get_cached, so an executable loaded from the persistent compilation cache counts
    too: a new program is counted whether or not the cache holds it."""
    return _count
