"""The endpoint audit: `verispec audit --endpoint URL` checks any OpenAI-compatible server
from outside. client.py sends the requests, counters.py reads the servers' /metrics,
runner.py builds the checks and the report (the offline audit's report format)."""
