"""One time-left estimate for a whole first start, across its phases (not per phase).

A model's first use hashes its files, converts it (a GGUF), quantizes substitutes, codes or packs the offloaded
layers and calibrates; each phase shows its own progress bar, and every bar also shows the time the *whole* start has
left: the running phase's own remaining time (from its rate so far), plus the phases still to come, each predicted
from its work (:func:`predict`: parameters, bytes, verifies) at this machine's rates and scaled by how the phases done
so far compared with their predictions (a slower machine is slower at every phase).

The load runs its phases inside :func:`first_start` with the pending phases' predictions; each phase asks :func:`bar`
for its progress bar (a plain ``tqdm`` outside a start). ``subspec plan`` prints :func:`predict`'s total for the
phases a first start would run.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from tqdm.auto import tqdm

PHASES = ("content digest", "conversion", "substitutes", "coding", "packing", "calibration")
"""A first start's phases, in the order a load runs them."""


@dataclass(frozen=True)
class PhaseRates:
    """How fast each phase of a first start goes on a kernel tier (2 threads, this project's machines).

    Attributes:
        convert: parameters per second of a GGUF's conversion to the compute dtype (read, de-quantized, written).
        digest: bytes per second of the content digest (sha256 of the model's files, read once).
        quantize: parameters per second of HQQ's substitutes (8 iterations).
        code: parameters per second of coding offloaded layers against their substitutes (encode, then a decode
            checked bit for bit).
        pack: bytes per second of packing plain offloaded layers into their files.
        calibrate: seconds of calibration per second of a one-token target forward (a few draft widths, verifies
            of the candidate tree sizes, each measured a few times).
    """

    convert: float
    digest: float
    quantize: float
    code: float
    pack: float
    calibrate: float


TIER_RATES = {
    # 2 threads; measured on Qwen2.5-Coder-1.5B at 2.5 GiB (README "First start": conversion 25-28 s for 1.78 G
    # parameters, substitutes 14-20 s for 1.31 G, coding 8.4 s for 0.93 G, calibration 8-18 s) and on the 7B-shaped
    # model (packing 10.7 GB in 13.7 s, calibration 36-49 s), rounded toward the slower machines
    "amx": PhaseRates(convert=65e6, digest=0.7e9, quantize=90e6, code=100e6, pack=0.7e9, calibrate=20.0),
    "avx512": PhaseRates(convert=65e6, digest=0.7e9, quantize=80e6, code=90e6, pack=0.7e9, calibrate=20.0),
    "avx2": PhaseRates(convert=60e6, digest=0.7e9, quantize=45e6, code=60e6, pack=0.7e9, calibrate=30.0),
    "portable": PhaseRates(convert=50e6, digest=0.7e9, quantize=5e6, code=5e6, pack=0.7e9, calibrate=60.0),
    None: PhaseRates(convert=50e6, digest=0.7e9, quantize=5e6, code=5e6, pack=0.7e9, calibrate=60.0),
}
"""Per kernel tier (None: torch's kernels)."""


def predict(tier: Optional[str], pending: dict[str, float]) -> dict[str, float]:
    """Predicted seconds of each phase (in :data:`PHASES` order) from its ``pending`` work
    (:func:`subspec.plan.first_start_work`: parameters to convert, bytes to hash, parameters to quantize and to code,
    bytes to pack, seconds of a one-token forward to calibrate against) at the kernel ``tier``'s rates
    (:data:`TIER_RATES`)."""
    r = TIER_RATES.get(tier, TIER_RATES[None])
    per = {"conversion": r.convert, "content digest": r.digest, "substitutes": r.quantize, "coding": r.code,
           "packing": r.pack}
    out = {k: w / per[k] for k, w in pending.items() if k in per and w > 0}
    if pending.get("calibration", 0) > 0:
        out["calibration"] = pending["calibration"] * r.calibrate
    return {k: out[k] for k in PHASES if k in out}


def fmt_seconds(s: float) -> str:
    """``s`` seconds as '45 s', '3 min 20 s' or '1 h 05 min'."""
    s = max(0, round(s))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class StartProgress:
    """The time left of one first start: ``predicted`` seconds by phase (only the phases this start runs), updated
    as each phase reports its progress (:meth:`bar`)."""

    def __init__(self, predicted: dict[str, float]):
        self.predicted = {k: max(0.0, v) for k, v in predicted.items()}
        self.actual: dict[str, float] = {}  # seconds of the phases done
        self.current: Optional[str] = None
        self._t0 = 0.0
        self._frac = 0.0

    def scale(self) -> float:
        """How the phases done so far compared with their predictions (1 before any is done), within 0.25..4."""
        done = [k for k in self.actual if self.predicted.get(k, 0) > 0]
        if not done:
            return 1.0
        ratio = sum(self.actual[k] for k in done) / sum(self.predicted[k] for k in done)
        return min(4.0, max(0.25, ratio))

    def left(self) -> float:
        """Seconds the whole start has left: the running phase's remaining (from its own rate once it is 5 % done,
        else its scaled prediction) plus the scaled predictions of the phases not started."""
        scale = self.scale()
        rest = sum(v for k, v in self.predicted.items() if k not in self.actual and k != self.current) * scale
        if self.current is None:
            return rest
        elapsed = time.perf_counter() - self._t0
        if self._frac >= 0.05:
            now = elapsed * (1.0 - self._frac) / self._frac
        else:
            now = max(0.0, self.predicted.get(self.current, 0.0) * scale - elapsed)
        return now + rest

    def begin(self, phase: str) -> None:
        """``phase`` starts: the phases before it that showed no bar (too little to do) are over."""
        self.end()
        for k in PHASES[:PHASES.index(phase)] if phase in PHASES else ():
            if k not in self.actual and k in self.predicted:
                self.skip(k)
        self.current, self._t0, self._frac = phase, time.perf_counter(), 0.0

    def skip(self, phase: str) -> None:
        """``phase`` is over without a measure (nothing to do after all): out of the time left and of the scale."""
        self.actual[phase] = 0.0
        self.predicted[phase] = 0.0

    def progress(self, frac: float) -> None:
        self._frac = min(1.0, max(0.0, frac))

    def end(self) -> None:
        if self.current is not None:
            self.actual[self.current] = time.perf_counter() - self._t0
            self.current = None

    def bar(self, phase: str, iterable: Optional[Iterable] = None, **kw) -> tqdm:
        """A progress bar for ``phase`` (tqdm arguments in ``kw``) whose postfix is the whole start's time left."""
        return _StartBar(self, phase, iterable, **kw)


class _StartBar(tqdm):
    """tqdm whose postfix says the whole first start's time left (:class:`StartProgress`)."""

    def __init__(self, start: StartProgress, phase: str, iterable=None, **kw):
        self._start = start
        self._weights: Optional[list[float]] = None
        start.begin(phase)
        super().__init__(iterable, **kw)
        if self.disable:  # nothing to do
            start.skip(phase)
            start.current = None
        self._say()

    def weigh(self, weights: list[float]) -> None:
        """Items of unequal cost: ``weights`` (one per item, any unit) make the phase's fraction done the weight done,
        not the count (:func:`weigh`)."""
        self._weights = [max(0.0, float(w)) for w in weights]

    def _fraction(self, n: int) -> float:
        w = self._weights
        if w and sum(w) > 0:
            return sum(w[:n]) / sum(w)
        return n / self.total if self.total else 0.0

    def _say(self) -> None:
        if self.total:
            self._start.progress(self._fraction(self.n))
        self.set_postfix_str(f"first start: ~{fmt_seconds(self._start.left())} left", refresh=False)

    def update(self, n=1):
        out = super().update(n)
        self._say()
        return out

    def __iter__(self):
        done = 0
        for x in super().__iter__():
            yield x
            done += 1
            if self.total:
                self._start.progress(self._fraction(done))
            self.set_postfix_str(f"first start: ~{fmt_seconds(self._start.left())} left", refresh=False)

    def close(self):
        if not getattr(self, "_ended", False):
            self._ended = True
            self._start.end()
        return super().close()


_current: contextvars.ContextVar[Optional[StartProgress]] = contextvars.ContextVar("subspec_start", default=None)


@contextlib.contextmanager
def first_start(predicted: dict[str, float]) -> Iterator[Optional[StartProgress]]:
    """Run a load's phases with one time-left estimate across them (nothing to estimate: no estimate)."""
    if not any(v > 0 for v in predicted.values()):
        yield None
        return
    token = _current.set(StartProgress(predicted))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def weigh(progress_bar: tqdm, weights: list[float]) -> None:
    """Tell a phase's bar (:func:`bar`) what its items cost relative to each other (e.g. seconds measured or
    expected), so the start's time left follows the work rather than the item count; a plain tqdm ignores it."""
    if isinstance(progress_bar, _StartBar):
        progress_bar.weigh(weights)


def bar(phase: str, iterable: Optional[Iterable] = None, **kw) -> tqdm:
    """The progress bar of ``phase`` (one of :data:`PHASES`): with the whole start's time left inside
    :func:`first_start`, else a plain ``tqdm``."""
    start = _current.get()
    if start is None:
        return tqdm(iterable, **kw)
    return start.bar(phase, iterable, **kw)
