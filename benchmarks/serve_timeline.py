"""Where a served round's time goes, in the server's process (benchmarks/serve_load.py): the engine thread's steps and
the time between them, a sleeper thread's wake-up lag (how long other threads hold the GIL), and garbage
collections."""

import gc
import statistics
import threading
import time


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Collections:
    """This process's garbage collections: (generation, wall-clock start, seconds paused)."""

    def __init__(self):
        self.events, self._began = [], 0.0
        gc.callbacks.append(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.time()
        else:
            self.events.append((info["generation"], self._began, time.time() - self._began))

    def within(self, span: tuple[float, float]) -> tuple[float, int]:
        """(seconds paused, collections of the oldest generation) in the wall-clock `span`."""
        inside = [(generation, seconds) for generation, start, seconds in self.events if span[0] <= start <= span[1]]
        return sum(seconds for _, seconds in inside), sum(generation == 2 for generation, _ in inside)


class StepTimeline:
    """The live engine's steps as (wall-clock start, end), the server's requests' arrival times (`serving`) and its
    rows' submission times, and the lateness of a thread that sleeps 2 ms at a time."""

    SLEEP_S = 0.002

    def __init__(self, engine):
        self.steps, self.wakes, self.submits, self.arrivals = [], [], [], []
        step, submit = engine._step, engine.submit

        def timed():
            began = time.time()
            step()
            self.steps.append((began, time.time()))

        def submitted(*args, **kwargs):
            self.submits.append(time.time())
            return submit(*args, **kwargs)

        engine._step = timed  # the engine thread calls self._step() between its admissions
        engine.submit = submitted
        threading.Thread(target=self._sleeper, daemon=True).start()

    def serving(self, app):
        """`app` (ASGI) noting when each HTTP request reaches the server's event loop."""

        async def noted(scope, receive, send):
            if scope["type"] == "http":
                self.arrivals.append(time.time())
            await app(scope, receive, send)

        return noted

    def _sleeper(self) -> None:
        while True:
            began = time.time()
            time.sleep(self.SLEEP_S)
            self.wakes.append((began, time.time() - began - self.SLEEP_S))

    def within(self, span: tuple[float, float]) -> dict:
        steps = [(start, end) for start, end in self.steps if span[0] <= start <= span[1]]
        gaps = [later[0] - earlier[1] for earlier, later in zip(steps, steps[1:])]
        lags = [lag for start, lag in self.wakes if span[0] <= start <= span[1]] or [0.0]
        submits, arrivals = ([1e3 * (when - span[0]) for when in times if span[0] <= when <= span[1]] or [float("nan")]
                             for times in (self.submits, self.arrivals))
        return {"steps": len(steps), "in_steps_s": round(sum(end - start for start, end in steps), 3),
                "between_steps_s": round(sum(gaps), 3), "longest_gap_ms": round(1e3 * max(gaps, default=0.0), 1),
                "wake_lag_p99_ms": round(1e3 * percentile(lags, 99), 2),
                "wake_lag_median_ms": round(1e3 * statistics.median(lags), 2),
                "before_first_step_ms": round(1e3 * (steps[0][0] - span[0]), 1) if steps else None,
                "after_last_step_ms": round(1e3 * (span[1] - steps[-1][1]), 1) if steps else None,
                "first_arrival_ms": round(min(arrivals), 1), "first_submit_ms": round(min(submits), 1),
                "last_submit_ms": round(max(submits), 1)}
