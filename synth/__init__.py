"""The Syn-GRPO data server: foreground-consistent repainting behind an HTTP API (see docs/data_server.md).

Training imports only ``synth.api`` and ``synth.client``; the server, worker and painters run in their own processes.
"""
