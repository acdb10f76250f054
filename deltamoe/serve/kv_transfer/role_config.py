"""The P/D role options, checked before torch or the model loads (the CLI's fast path)."""

from __future__ import annotations

from deltamoe.errors import ConfigError

ROLES = ("colocated", "prefill", "decode")
TRANSPORTS = ("mooncake",)
DIRECT_MAX_SEGMENTS = 32  # `HandOffConfig.direct_max_segments`'s default, here for the CLI's torch-free options
INLINE_WRITE = "8MiB"  # `HandOffConfig.inline_write_bytes`'s default, likewise
# `HandOffConfig.markers`'s default, likewise: off, since on a quiet machine the transfer engine's notice
# (one write carrying it) landed small and mid-sized hand-offs sooner than a marker's second write did
# (docs/serving-disagg.md, "Completion markers").
MARKERS = False


def check_role(role: str, kv_transfer: str | None) -> None:
    """Before anything loads: a known role, and a transport exactly when the role needs one."""
    if role not in ROLES:
        raise ConfigError(f"expected one of {list(ROLES)}, got {role!r}", field="role")
    if kv_transfer is not None and kv_transfer not in TRANSPORTS:
        raise ConfigError(f"expected one of {list(TRANSPORTS)}, got {kv_transfer!r}", field="kv_transfer")
    if role != "colocated" and kv_transfer is None:
        raise ConfigError(f"the {role} role needs a transport", field="kv_transfer", hint="--kv-transfer mooncake")
    if role == "colocated" and kv_transfer is not None:
        raise ConfigError("a colocated server hands nothing off", field="kv_transfer",
                          hint="add --role prefill or --role decode")
