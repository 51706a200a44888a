"""fp4moe's environment variables, parsed one way everywhere: a switch takes ``1`` / ``true`` /
``yes`` / ``on`` or ``0`` / ``false`` / ``no`` / ``off`` (any case, spaces ignored; unset or empty:
its default), a choice one of its named values; anything else is a ValueError naming the variable,
the value and what it takes, raised where the variable is read (a typo is never silently ignored).

``FP4MOE_AUTOLOAD`` is read by the start-up hook (``fp4moe_autoload``), which imports nothing heavy
and must never stop a program from starting: it takes the same words, and any other value leaves
it on (``ON_WORDS`` / ``OFF_WORDS`` are its lists too; ``tests/test_env_parsing.py`` keeps them equal).
"""

from __future__ import annotations

import os

ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off")


def env_switch(name: str, default: bool | None = None) -> bool | None:
    """The switch ``name`` as True / False, or ``default`` where it is unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in ON_WORDS:
        return True
    if value in OFF_WORDS:
        return False
    raise ValueError(f"environment variable {name}={raw!r} is not understood: it takes "
                     f"{'/'.join(ON_WORDS)} or {'/'.join(OFF_WORDS)}, or unset for the default")


def env_choice(name: str, choices: tuple[str, ...], default: str | None = None) -> str | None:
    """The choice ``name`` (lower-cased; one of ``choices``), or ``default`` where it is unset or empty."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"environment variable {name}={raw!r} is not understood: it takes "
                         f"{' or '.join(repr(c) for c in choices)}, or unset for the default")
    return value


# The Triton backend's switches (read by fp4moe_ops/backends/triton_moe/launch.py): FP4MOE_GLUON off
# (never the Gluon kernels) or on (also on an untested Triton; unset: on where tested),
# FP4MOE_COMPILE_AHEAD off (compile each bucket's kernels when first reached; unset: on),
# FP4MOE_RELAUNCH off (every launch through Triton's own call path; relaunch.py; unset: on)
BACKEND_SWITCHES = ("FP4MOE_GLUON", "FP4MOE_COMPILE_AHEAD", "FP4MOE_RELAUNCH")


def check_backend_environment() -> None:
    """Raise ValueError naming any of :data:`BACKEND_SWITCHES` set to a value :func:`env_switch`
    does not understand; called wherever a backend is resolved, before any kernel runs (the
    launcher itself reads them where a failure would be far from the user's call)."""
    for name in BACKEND_SWITCHES:
        env_switch(name)


__all__ = ["OFF_WORDS", "ON_WORDS", "BACKEND_SWITCHES", "check_backend_environment", "env_choice", "env_switch"]
