"""The simulator's engine: tokens/s against running requests, fitted to (or read from) measured points.

``EngineModel`` (processor sharing: each running request gets ``T(r) / r``), the saturating curve
``T(r) = peak x r / (r + c_half)`` and its least-relative-squares fit (``fit_saturation``), the fit's
error per measured point, and the reader of ``benchmarks/engine_curve.py``'s JSON. Pure but for ``load_curve``.

    m = EngineModel.from_measured(load_curve("benchmarks/baselines/engine_curve.json"), max_running=24)
    m.tok_s(8)   # tokens/s of one engine running 8 requests
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineModel:
    """One engine's generated tokens/s against the requests it runs, ``T(r)``; each running request
    gets ``T(r) / r`` (processor sharing).

    ``T`` is the measured curve when ``curve`` is given (piecewise linear through (0, 0) and the
    points, flat past the last one: an extrapolation), else the saturating curve fitted to it,
    ``T(r) = peak_tok_s x r / (r + c_half)`` (``fit_saturation``; ``benchmarks/engine_curve.py``
    measures the CPU engine's). Neither is assumed flat at a knee: the engine keeps gaining a little
    from more requests, with diminishing returns, as the measured one does.
    """

    peak_tok_s: float = 4000.0
    """The asymptote of the fitted curve (tokens/s of one engine at unbounded concurrency)."""
    c_half: float = 8.0
    """Running requests at which an engine makes half its peak tokens/s."""
    max_running: int = 32
    """Requests it runs at once (SGLang --max-running-requests); more queue."""
    curve: tuple[tuple[float, float], ...] = ()
    """Measured (running requests, tokens/s) points; when given they replace the fitted curve."""

    def __post_init__(self):
        if self.peak_tok_s <= 0 or self.c_half <= 0 or self.max_running < 1:
            raise ValueError(f"EngineModel: peak_tok_s, c_half and max_running must be positive, got {self}")
        xs = [c for c, _ in self.curve]
        if self.curve and (xs != sorted(set(xs)) or xs[0] <= 0 or any(t <= 0 for _, t in self.curve)):
            raise ValueError(
                f"EngineModel.curve: concurrencies must be positive and increasing and tokens/s "
                f"positive, got {self.curve}"
            )

    def tok_s(self, r: int) -> float:
        """Generated tokens/s of one engine running ``r`` requests."""
        if r <= 0:
            return 0.0
        if not self.curve:
            return saturation_tok_s(r, self.peak_tok_s, self.c_half)
        x0, t0 = 0.0, 0.0
        for x1, t1 in self.curve:
            if r <= x1:
                return t0 + (t1 - t0) * (r - x0) / (x1 - x0)
            x0, t0 = x1, t1
        return t0

    @classmethod
    def from_measured(cls, points: list[tuple[float, float]], *, max_running: int, table: bool = False) -> EngineModel:
        """The model fitted to measured (concurrency, tokens/s) points (``table``: the points themselves)."""
        peak, c_half = fit_saturation(points)
        return cls(
            peak_tok_s=peak,
            c_half=c_half,
            max_running=max_running,
            curve=tuple((float(c), float(t)) for c, t in sorted(points)) if table else (),
        )


def saturation_tok_s(c: float, peak: float, c_half: float) -> float:
    """``peak x c / (c + c_half)``: linear at low concurrency, half the peak at ``c_half``, saturating."""
    return peak * c / (c + c_half)


def fit_saturation(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(peak, c_half)`` of ``saturation_tok_s`` minimising the squared *relative* error over the
    measured (concurrency, tokens/s) points: a log grid over ``c_half`` (ratio 1.002, from 1/1000 of
    the smallest to 1000 x the largest concurrency), the best ``peak`` for each in closed form."""
    pts = [(float(c), float(t)) for c, t in points]
    if len(pts) < 2 or any(c <= 0 or t <= 0 for c, t in pts):
        raise ValueError(f"fit_saturation: needs >= 2 points with positive concurrency and tokens/s, got {points}")
    lo, hi = min(c for c, _ in pts) / 1000, max(c for c, _ in pts) * 1000
    best = (math.inf, 0.0, 0.0)
    h = lo
    while h <= hi:
        a = [(c / (c + h)) / t for c, t in pts]  # fit / measured = peak x a_i
        peak = sum(a) / sum(x * x for x in a)
        err = sum((peak * x - 1) ** 2 for x in a)
        best = min(best, (err, peak, h))
        h *= 1.002
    return best[1], best[2]


def curve_fit_report(points: list[tuple[float, float]], peak: float, c_half: float) -> list[dict]:
    """Per measured point: the fitted tokens/s and the relative error (fit / measured - 1)."""
    return [
        {
            "concurrency": c,
            "tok_s": t,
            "fit_tok_s": saturation_tok_s(c, peak, c_half),
            "rel_err": saturation_tok_s(c, peak, c_half) / t - 1,
        }
        for c, t in points
    ]


def load_curve(path: str) -> list[tuple[float, float]]:
    """Measured (concurrency, tokens/s) points from ``benchmarks/engine_curve.py``'s JSON."""
    try:
        data = json.loads(open(path).read())
        return [(float(p["concurrency"]), float(p["tok_s"])) for p in data["curve"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"--engine-curve {path!r}: not an engine_curve.py result (a 'curve' list of "
            f"{{'concurrency', 'tok_s'}}): {e}"
        ) from e
