"""The endpoint audit: `verispec audit --endpoint URL` checks any OpenAI-compatible server
from outside. client.py sends the requests, counters.py reads the servers' /metrics,
checks.py holds the audit's state (the checks read it; each check's endpoint half sits
beside its offline half in audit/), runner.py runs the registered checks and writes the
report (the offline audit's report format)."""
