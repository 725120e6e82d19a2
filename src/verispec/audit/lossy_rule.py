"""Whether the verification rule is exact: offline from the audited configuration, from
outside from what a verispec server says of its rule (other servers do not say)."""

from __future__ import annotations

from ..verify import LOSSY_RULES
from .checks import CheckResult
from .endpoint.state import EndpointAudit


def lossy_rule_check(config) -> CheckResult:
    lossy = config.rule in LOSSY_RULES
    summary = (f"rule {config.rule!r} is LOSSY: output is not distributed as the target's"
               if lossy else f"rule {config.rule!r} is exact")
    return CheckResult(not lossy, summary,
                       {"rule": config.rule, "lossy": lossy, "lossy_rules": sorted(LOSSY_RULES)})


def endpoint_lossy_rule_check(a: EndpointAudit) -> CheckResult | None:
    """Only a verispec server says which rule it verifies with; others: not applicable."""
    if a.info.kind != "verispec" or "rule" not in a.info.speculative:
        return None
    lossy = bool(a.info.speculative.get("lossy"))
    rule = a.info.speculative["rule"]
    return CheckResult(not lossy, f"server rule {rule!r} is " + ("LOSSY" if lossy else "exact"),
                       {"rule": rule, "lossy": lossy})
