"""A painter for server tests: the real procedural painter, slowed down per job seed (``painter.name:
tests.slow_painter:SeedDelayPainter``), so a test can make one job outlast another without mocking anything."""

from __future__ import annotations

import time

from synth.painters import ProceduralPainter


class SeedDelayPainter(ProceduralPainter):
    """``delays``: seed -> seconds to sleep before painting a job with that seed (other seeds: no delay)."""

    def __init__(self, delays: dict | None = None, device: str | None = None):
        super().__init__(device=device)
        self.delays = {int(k): float(v) for k, v in (delays or {}).items()}

    def paint(self, jobs):
        for job in jobs:
            time.sleep(self.delays.get(job.seed, 0.0))
        return super().paint(jobs)
