"""Pure verification rules: rejection (exact), greedy, coupled (exact, seeded and
reproducible), typical-lossy (lossy, Medusa)."""

from verispec.verify.rules import (
    LOSSY_RULES,
    PAD,
    RESIDUAL_EPS,
    RULES,
    VerifyResult,
    coupled,
    greedy,
    rejection,
    sample_from_probs,
    typical_lossy,
    verify,
)

__all__ = [
    "LOSSY_RULES",
    "PAD",
    "RESIDUAL_EPS",
    "RULES",
    "VerifyResult",
    "coupled",
    "greedy",
    "rejection",
    "sample_from_probs",
    "typical_lossy",
    "verify",
]
